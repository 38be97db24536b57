# tbegen developer tasks. `make test` is the test command CI runs (see README.md).
PYTHON ?= python3
export TBEGEN_BUILD_DIR ?= $(CURDIR)/build/ext

.PHONY: setup demo generate check test test-cuda-build test-gpu bench-gpu

setup:            ## install tbegen and its test dependencies (torch only if none is installed)
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.14.1"
	$(PYTHON) -m pip install -e ".[test]"

demo: setup       ## the main job: render, build and train a small CTR model on the CPU
	$(PYTHON) -m tbegen render --optimizer rowwise_adagrad
	$(PYTHON) examples/ctr_training.py

generate:         ## re-render every spec into generated/
	$(PYTHON) -m tbegen render --all

check:            ## fail with a diff if generated/ is not a fresh render
	$(PYTHON) -m tbegen check

test:             ## CPU suite + compile-and-link of every CUDA extension (where nvcc exists)
	$(PYTHON) -m tbegen check
	$(PYTHON) -m pytest -q

test-gpu:         ## on a GPU machine: the CUDA suite, sanitizers, benchmarks
	benchmarks/run_gpu.sh
