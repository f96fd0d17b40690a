# Two commands on a fresh machine:  make demo  and  make test.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python

NBVAL   = --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

.PHONY: venv demo test notebooks benchmarks clean

venv: $(VENV)/.installed

# constraints.txt pins the torch this project is tested with; pyproject.toml only ranges
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[notebooks,test]'
	touch $@

demo: venv
	$(VENV)/bin/d2l-launch -n 2 -s 2 python examples/multimachine_cifar10_train.py --kvstore dist_sync --data digits

# the tests, and every chapter re-executed and compared with its committed outputs
test: venv
	$(PY) -m pytest tests notebooks/*.ipynb $(NBVAL)

# re-execute the chapters in place (after changing one), saving outputs and widget state
notebooks: venv
	$(PY) notebooks/run.py

benchmarks: venv
	$(PY) benchmarks/kvstore.py
	$(PY) benchmarks/allreduce.py
	$(PY) benchmarks/train_throughput.py
	$(PY) benchmarks/scaling.py

clean:
	rm -rf $(VENV) .pytest_cache
