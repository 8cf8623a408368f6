# The two commands of README.md: `make pretrain` (the main job) and `make test` (every test).
# Each creates and fills the local virtualenv .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RANKS ?= 2
CONFIG ?= ds_configs/scape.json
export OMP_NUM_THREADS ?= 1

.PHONY: install pretrain test bench-bytes bench-overhead clean

$(BIN)/.installed: setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test,mpi]'
	touch $@

install: $(BIN)/.installed

pretrain: install
	$(BIN)/deepspeed --num_gpus $(RANKS) launch/pretrain.py --deepspeed_config $(CONFIG) $(ARGS)

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests $(ARGS)

bench-bytes: install
	$(BIN)/python bench/bytes.py

bench-overhead: install
	$(BIN)/python bench/overhead.py

clean:
	rm -rf runs checkpoints
