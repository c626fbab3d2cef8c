# `make setup` is idempotent: it (re)does only what is out of date.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.etmlx-deps
LIB := backends/mlx/runtime/_lib/libetmlx_backend.so
RUNTIME_SOURCES := CMakeLists.txt $(wildcard backends/mlx/runtime/*.cpp backends/mlx/runtime/*.h backends/mlx/runtime/generated/* tests/cpp/*.cpp)

.PHONY: setup test demo bench regenerate clean

setup: $(DEPS_STAMP) $(LIB)

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): requirements.txt pyproject.toml | $(VPY)
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet -r requirements.txt
	$(VPY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

$(LIB): $(DEPS_STAMP) $(RUNTIME_SOURCES)
	$(VENV)/bin/cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(abspath $(VPY)) > build.log 2>&1 || (cat build.log; exit 1)
	$(VENV)/bin/cmake --build build -j2 >> build.log 2>&1 || (cat build.log; exit 1)
	@touch $@

test: setup
	$(VPY) -m pytest -q

demo: setup
	$(VENV)/bin/etmlx demo

regenerate: $(DEPS_STAMP)
	$(VPY) -m backends.mlx.serialization.generate

clean:
	rm -rf build build.log backends/mlx/runtime/_lib
