# Each target installs what it needs into .venv/ first (once; again when pyproject.toml
# or constraints.txt change). torch stays at the CPU build through constraints.txt.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo hospitals test bench proto clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/conclave demo

hospitals: $(STAMP)
	$(BIN)/conclave run configs/hospitals.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=20

bench: $(STAMP)
	$(BIN)/python bench/teacher_student_mnist.py
	$(BIN)/python bench/active_learning_mnist.py
	$(BIN)/python bench/sparse_finetune.py
	$(BIN)/python bench/service_soak.py
	$(BIN)/python bench/perf.py
	$(BIN)/python bench/gateway_overhead.py

proto: $(STAMP)
	$(BIN)/python -m conclave.protos.generate

clean:
	rm -rf $(VENV) build *.egg-info
