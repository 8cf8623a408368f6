# The two commands of README.md: `make pretrain` (the main job) and `make test` (every test);
# `make test-fast` runs the fast tier (tests/README.md). Each creates and fills .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RANKS ?= 2
CONFIG ?= ds_configs/scape_dct.json
export OMP_NUM_THREADS ?= 1

# `make wheelhouse`: wheels of scape_ds and everything it needs, for compute nodes without a package
# index (docs/install.md, "Offline install"); for another interpreter or platform give PY_VERSION and PLATFORM.
PY_VERSION ?= 3.11
PLATFORM ?= manylinux_2_28_x86_64
WHEELHOUSE ?= wheelhouse
DEEPSPEED_VERSION := $(shell sed -n 's/^deepspeed==//p' constraints.txt)

.PHONY: install pretrain test test-slow test-all test-fast lint bench-bytes bench-overhead wheelhouse clean

# constraints.txt pins the tested versions; setup.py asks only for ranges (keeps a user's CUDA torch)
$(BIN)/.installed: setup.py constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test,mpi]'
	touch $@

install: $(BIN)/.installed

pretrain: install
	$(BIN)/deepspeed --num_gpus $(RANKS) launch/pretrain.py --deepspeed_config $(CONFIG) $(ARGS)

# every test but the slow tier (CI runs this; under 25 minutes on 2 cores); test-slow runs the slow
# tier, test-all both
test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow" tests $(ARGS)

test-slow: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m slow tests $(ARGS)

test-all: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests $(ARGS)

# unit tests and the quick multi-rank tests: no launcher, MPI, root, slow or GPU tests
FAST := not (launcher or mpi or root or slow or gpu)
test-fast: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "$(FAST)" tests $(ARGS)

lint: install
	$(BIN)/python -m ruff check .

bench-bytes: install
	$(BIN)/python bench/bytes.py

bench-overhead: install
	$(BIN)/python bench/overhead.py

# 1. deepspeed is published as a source archive only: build a pure wheel of it (DS_BUILD_OPS=0, its
#    ops are compiled on first use, as in a plain pip install); 2. a pure wheel of scape_ds;
# 3. pip download resolves scape_ds[mpi] for the target interpreter and platform, with those two
#    wheels as the only candidates for themselves and binary wheels for everything else. pip takes
#    --platform literally, so a manylinux_2_N target also lists every older manylinux tag. triton's
#    pin is left out: a CUDA torch pins the triton it was built with.
PLATFORM_ARGS = $(shell $(PY) -c 'import re, sys; p = sys.argv[1]; m = re.fullmatch(r"manylinux_2_(\d+)_(.+)", p); \
	old = [f"manylinux_2_{v}_{m[2]}" for v in range(int(m[1]), 4, -1)] + [f"{a}_{m[2]}" for a, v in \
	(("manylinux2014", 17), ("manylinux2010", 12), ("manylinux1", 5)) if v <= int(m[1])] if m else [p]; \
	print(" ".join("--platform " + t for t in old))' $(PLATFORM))

wheelhouse: install
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	DS_BUILD_OPS=0 $(BIN)/pip wheel -q --no-deps --no-build-isolation -w $(WHEELHOUSE) deepspeed==$(DEEPSPEED_VERSION)
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w $(WHEELHOUSE) .
	grep -v '^triton' constraints.txt > $(WHEELHOUSE)/constraints.txt
	$(BIN)/pip download -q --only-binary=:all: --python-version $(PY_VERSION) $(PLATFORM_ARGS) \
		-c $(WHEELHOUSE)/constraints.txt --find-links $(WHEELHOUSE) -d $(WHEELHOUSE) \
		"$$(ls $(WHEELHOUSE)/scape_ds-*.whl)[mpi]"
	@ls $(WHEELHOUSE)/*.whl | wc -l | xargs echo "wheels in $(WHEELHOUSE):"

clean:
	rm -rf runs checkpoints
