# Two commands on a fresh machine:  make demo  and  make test.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python

.PHONY: venv demo test benchmarks clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[notebooks,test]'
	touch $@

demo: venv
	$(VENV)/bin/d2l-launch -n 2 -s 2 python examples/multimachine_cifar10_train.py --kvstore dist_sync --data digits

test: venv
	$(PY) -m pytest

benchmarks: venv
	$(PY) benchmarks/kvstore.py
	$(PY) benchmarks/allreduce.py
	$(PY) benchmarks/train_throughput.py
	$(PY) benchmarks/scaling.py

clean:
	rm -rf $(VENV) .pytest_cache
