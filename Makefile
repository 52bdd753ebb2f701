# The two commands of the README:  `make demo`  and  `make test`.
# Both build the virtual environment in .venv first (torch from this machine's disk where pip has it).
VENV := .venv
PY := $(VENV)/bin/python
# the venv's ninja must come first: another ninja makes DeepSpeed rebuild its CPU comm op
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: demo test test-fast lint clean

# uv installs the versions pip installs (the same `pip freeze` here) in a quarter of pip's time: ~45 s
# against ~2 min 45 s on 2 cores, most of it torch's CUDA wheels; --compile-bytecode writes the .pyc files
# as pip does, not each launch's first ranks at once. uv reads no pip.conf: `make INSTALLER=pip` where pip's
# configuration names an index of your own.
# The last step builds DeepSpeed's CPU comm op now (~1 min on 2 cores) rather than in the first launch, whose
# ranks would both wait on torch's build lock; a GPU build of DeepSpeed has none to build
INSTALLER ?= uv
$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
ifeq ($(INSTALLER),uv)
	$(PY) -m pip install -q uv
	$(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode torch==2.14.1 torchvision==0.29.1 -e '.[dev]'
else
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[dev]'
endif
	$(PY) -c "from deepspeed.accelerator import get_accelerator as a; b = a().create_op_builder('ShareMemCommBuilder'); b is None or not b.is_compatible() or b.load()"
	touch $@

demo: $(VENV)/.installed
	bash launchers/demo.sh

# three pytest-xdist workers: the launched tests one after another on one, the in-process tests on one
# thread each on the other two, a module at a time, in the time the launches leave (tests/conftest.py)
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 3 --durations=15

# the edit-test loop: the in-process tests but the slowest (tests/conftest.py SLOW), none that launches
# ranks (tests/launched/)
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" tests --ignore=tests/launched

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf runs/toy data/toy
