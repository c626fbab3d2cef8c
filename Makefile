# `make setup` is idempotent: it (re)does only what is out of date.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# MLX=cpu (default), cuda12 or cuda13: which build of libmlx the venv gets and the runtime links.
# The CUDA builds have the same C++ API, so the same sources build against them.
MLX ?= cpu
ifeq ($(MLX),cpu)
MLX_PIP :=
else ifeq ($(MLX),cuda12)
MLX_PIP := mlx[cuda12]==0.32.4
else ifeq ($(MLX),cuda13)
MLX_PIP := mlx[cuda13]==0.32.4
else
$(error MLX=$(MLX) is not cpu, cuda12 or cuda13)
endif
# One stamp per MLX build (the CPU one keeps its old name), so switching MLX= reinstalls.
ALL_STAMPS := $(VENV)/.etmlx-deps $(VENV)/.etmlx-deps-cuda12 $(VENV)/.etmlx-deps-cuda13
DEPS_STAMP := $(if $(filter cpu,$(MLX)),$(VENV)/.etmlx-deps,$(VENV)/.etmlx-deps-$(MLX))
LIB := backends/mlx/runtime/_lib/libetmlx_backend.so
RUNNER := backends/mlx/runtime/_lib/libetmlx_runner.so
DECODE := build/etmlx_decode
BENCH := build/etmlx_bench
IMAGE_READ := build/etmlx_image_read
RUNTIME_SOURCES := CMakeLists.txt $(wildcard backends/mlx/runtime/*.cpp backends/mlx/runtime/*.h backends/mlx/runtime/kernels/*.cpp backends/mlx/runtime/kernels/*.h backends/mlx/runtime/generated/* tests/cpp/*.cpp backends/mlx/tools/etmlx_decode/*.cpp backends/mlx/tools/etmlx_decode/*.h backends/mlx/tools/etmlx_bench/*.cpp)

.PHONY: setup develop test test-fast demo bench bench-deps regenerate check-macos clean

setup: $(DEPS_STAMP) $(LIB) $(RUNNER) $(DECODE) $(BENCH) $(IMAGE_READ)

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): requirements.txt pyproject.toml | $(VPY)
	$(VPY) -m pip install --quiet torch==2.13.0
ifeq ($(MLX),cpu)
	$(VPY) -m pip install --quiet -r requirements.txt
else
	grep -v '^mlx\[cpu\]' requirements.txt > $(VENV)/requirements-$(MLX).txt
	$(VPY) -m pip uninstall --quiet --yes mlx-cpu || true
	$(VPY) -m pip install --quiet -r $(VENV)/requirements-$(MLX).txt "$(MLX_PIP)"
endif
	rm -f $(filter-out $(DEPS_STAMP),$(ALL_STAMPS))
	$(MAKE) --no-print-directory develop VENV=$(VENV)
	touch $@

# The checkout as an editable install (the `etmlx` command, its version, `import backends` and `import etmlx`
# from here). pyproject.toml's editable override runs no CMake (the rules below build the runtime), and the
# import hook scikit-build-core's editable .pth installs is dropped, keeping only the path line: the hook sits
# first on sys.meta_path and would import this checkout even where PYTHONPATH names another (a worktree).
develop: | $(VPY)
	$(VPY) -m pip install --quiet --no-deps --no-build-isolation -e .
	sed -i '/^import _editable_skbc_/d' "$$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_editable_skbc_etmlx.pth"

CONFIGURE := $(VENV)/bin/cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(abspath $(VPY))

$(LIB): $(DEPS_STAMP) $(RUNTIME_SOURCES)
	$(CONFIGURE) > build.log 2>&1 || (cat build.log; exit 1)
	$(VENV)/bin/cmake --build build -j2 >> build.log 2>&1 || (cat build.log; exit 1)
	@touch $@

# The $(LIB) build above builds every target, this one too; this rule catches
# a deleted binary or build directory.
$(DECODE): $(LIB)
	@test -f build/CMakeCache.txt || $(CONFIGURE) > build.log 2>&1 || (cat build.log; exit 1)
	$(VENV)/bin/cmake --build build -j2 --target etmlx_decode >> build.log 2>&1 || (cat build.log; exit 1)
	@touch $@

# The runner library (decode-step rules, draft sources) beside the backend's.
$(RUNNER): $(LIB)
	@test -f build/CMakeCache.txt || $(CONFIGURE) > build.log 2>&1 || (cat build.log; exit 1)
	$(VENV)/bin/cmake --build build -j2 --target etmlx_runner >> build.log 2>&1 || (cat build.log; exit 1)
	@touch $@

$(BENCH): $(LIB)
	@test -f build/CMakeCache.txt || $(CONFIGURE) > build.log 2>&1 || (cat build.log; exit 1)
	$(VENV)/bin/cmake --build build -j2 --target etmlx_bench >> build.log 2>&1 || (cat build.log; exit 1)
	@touch $@

# The image-file reader's test program (tests/test_image_file_cpp.py).
$(IMAGE_READ): $(LIB)
	@test -f build/CMakeCache.txt || $(CONFIGURE) > build.log 2>&1 || (cat build.log; exit 1)
	$(VENV)/bin/cmake --build build -j2 --target etmlx_image_read >> build.log 2>&1 || (cat build.log; exit 1)
	@touch $@

# Test tiers (docs/contributing.md, "Test tiers"). Both run on every core (pytest-xdist; TEST_JOBS=1 for one process), one
# test file per worker, so a file's module fixtures (exported programs) are built once; tests taking
# longer than pyproject.toml's timeout fail (PYTEST_TIMEOUT=N to change it).
#   test-fast: unit and parity tests (no servers, long child processes, benchmarks or training)
#   test:      everything
TEST_JOBS ?= auto
PYTEST := $(VPY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=30
FAST_TESTS := not (server or subprocess or bench or slow)

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "$(FAST_TESTS)"

demo: setup
	$(VENV)/bin/etmlx demo

# Optional baseline for `etmlx bench decode --shape`: llama.cpp through llama-cpp-python, built from its sdist for
# this CPU (about 20 minutes on 2 cores); never needed by setup or the tests.
# llama.cpp built for this CPU (GGML_NATIVE); on a CPU with AMX that also compiles ggml's AMX tile code, which
# crashed (a general protection fault at ldtilecfg) on a 2-core Xeon VM: there its AVX-512 flags are listed instead.
LLAMA_CPU_FLAGS := $(if $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo amx),-DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
  -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON,-DGGML_NATIVE=ON)

bench-deps: setup
	CMAKE_ARGS="$(LLAMA_CPU_FLAGS)" $(VPY) -m pip install --quiet llama-cpp-python==0.3.36

regenerate: $(DEPS_STAMP)
	$(VPY) -m backends.mlx.serialization.generate

# The macOS arm64 build, checked here (cmake/macos/README.md): every native target compiled and linked for
# aarch64-macos with Zig against the macOS wheels of mlx and executorch, then its Mach-O files inspected
# (tests/macos/check_macos_build.py). Nothing is run. Everything lives in build-macos/; up to date, it takes
# seconds.
MACOS := build-macos
MACOS_TOOLS := $(MACOS)/tools/.etmlx-stamp
MACOS_WHEELS := $(MACOS)/site-packages/.etmlx-stamp
MACOS_STUBS := $(MACOS)/stubs/.etmlx-stamp
MACOS_CONFIGURED := $(MACOS)/cmake/CMakeCache.txt

check-macos: $(MACOS_CONFIGURED)
	$(VENV)/bin/cmake --build $(MACOS)/cmake -j2 > $(MACOS)/build.log 2>&1 || (tail -40 $(MACOS)/build.log; exit 1)
	ETMLX_MACOS_BUILD=$(MACOS) PYTHONPATH=$(MACOS)/tools $(VPY) -m pytest -q -p no:cacheprovider --noconftest tests/macos/check_macos_build.py

$(MACOS_TOOLS): cmake/macos/tools.txt | $(DEPS_STAMP)
	rm -rf $(MACOS)/tools
	$(VPY) -m pip install --quiet --target $(MACOS)/tools -r cmake/macos/tools.txt
	touch $@

$(MACOS_WHEELS): cmake/macos/wheels.txt cmake/macos/fetch.py requirements.txt | $(DEPS_STAMP)
	$(VPY) cmake/macos/fetch.py $(MACOS)
	touch $@

$(MACOS_STUBS): $(MACOS_WHEELS) $(MACOS_TOOLS) cmake/macos/stubs.py cmake/macos/macho.py
	PYTHONPATH=$(MACOS)/tools $(VPY) cmake/macos/stubs.py $(MACOS)
	touch $@

# A fresh build folder whenever the toolchain, the stubs or the wheels change (CMake re-runs by itself when only
# CMakeLists.txt does). Release, and only what a wheel ships (no C++ tests).
$(MACOS_CONFIGURED): $(MACOS_STUBS) cmake/macos/arm64-zig-toolchain.cmake cmake/macos/cross-fixups.cmake
	rm -rf $(MACOS)/cmake
	$(VENV)/bin/cmake -S . -B $(MACOS)/cmake --toolchain cmake/macos/arm64-zig-toolchain.cmake \
	  -DCMAKE_BUILD_TYPE=Release -DETMLX_BUILD_TESTS=OFF -DETMLX_ZIG=$(abspath $(MACOS)/tools/ziglang/zig) \
	  -DETMLX_MACOS_STUBS=$(abspath $(MACOS)/stubs) -DETMLX_SITE_PACKAGES=$(abspath $(MACOS)/site-packages) \
	  > $(MACOS)/configure.log 2>&1 || (cat $(MACOS)/configure.log; exit 1)

clean:
	rm -rf build build.log backends/mlx/runtime/_lib $(MACOS)
