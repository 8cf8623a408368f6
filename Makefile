# The two commands of README.md: `make pretrain` (the main job) and `make test` (every test);
# `make test-fast` runs the fast tier (tests/README.md). Each creates and fills .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RANKS ?= 2
CONFIG ?= ds_configs/scape.json
export OMP_NUM_THREADS ?= 1

.PHONY: install pretrain test test-fast lint bench-bytes bench-overhead clean

$(BIN)/.installed: setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test,mpi]'
	touch $@

install: $(BIN)/.installed

pretrain: install
	$(BIN)/deepspeed --num_gpus $(RANKS) launch/pretrain.py --deepspeed_config $(CONFIG) $(ARGS)

test: install
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

clean:
	rm -rf runs checkpoints
