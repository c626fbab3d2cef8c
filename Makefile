# `make setup` is idempotent: it (re)does only what is out of date.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.etmlx-deps
LIB := backends/mlx/runtime/_lib/libetmlx_backend.so
DECODE := build/etmlx_decode
RUNTIME_SOURCES := CMakeLists.txt $(wildcard backends/mlx/runtime/*.cpp backends/mlx/runtime/*.h backends/mlx/runtime/kernels/*.cpp backends/mlx/runtime/kernels/*.h backends/mlx/runtime/generated/* tests/cpp/*.cpp backends/mlx/tools/etmlx_decode/*.cpp backends/mlx/tools/etmlx_decode/*.h)

.PHONY: setup test demo bench regenerate clean

setup: $(DEPS_STAMP) $(LIB) $(DECODE)

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): requirements.txt pyproject.toml | $(VPY)
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet -r requirements.txt
	$(VPY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

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

test: setup
	$(VPY) -m pytest -q

demo: setup
	$(VENV)/bin/etmlx demo

regenerate: $(DEPS_STAMP)
	$(VPY) -m backends.mlx.serialization.generate

clean:
	rm -rf build build.log backends/mlx/runtime/_lib
