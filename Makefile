# Two commands on a fresh machine:  make demo  and  make test;  make lab  opens the chapters.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python

NBVAL   = --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg
# Another CPU's kernels: torch's portable ones and oneDNN without AVX. The chapters must
# pass nbval under them too (nbval compares only what any CPU prints).
OTHER_CPU = ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41

.PHONY: venv demo lab wheel test test-load test-fast test-jobs test-system notebooks figures refs reading-path prose book benchmarks gpu clean

venv: $(VENV)/.installed

# constraints.txt pins the torch this project is tested with; pyproject.toml only ranges.
# Every extra: vision (torchvision, for CIFAR-10), notebooks, test (pytest, build, pdoc).
# --no-compile: pip would byte-compile all 12,000 files (80 s of CPU on 2 cores); Python
# compiles the modules a process imports, once, on first use.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[vision,notebooks,test]'
	touch $@

demo: venv
	$(VENV)/bin/d2l-launch -n 2 -s 2 python examples/multimachine_cifar10_train.py --kvstore dist_sync --data digits

# the chapters in JupyterLab; each chapter's kernel runs in notebooks/
lab: venv
	$(VENV)/bin/jupyter lab notebooks/

# the wheel and the sdist, in dist/: pip install dist/d2ldist-*.whl gives d2l-launch,
# %load_ext d2ldist, the examples (python -m d2ldist.examples) and d2l-book. Needs only
# PyPA's build, in a small venv of its own (build/builder), not .venv and its extras.
BUILDER = build/builder
wheel: $(BUILDER)/bin/pyproject-build
	$(BUILDER)/bin/pyproject-build --outdir dist .

$(BUILDER)/bin/pyproject-build:
	$(PYTHON) -m venv $(BUILDER)
	$(BUILDER)/bin/python -m pip install -q build

# Two test files at a time (pytest-xdist): most tests wait on processes, so two share the
# 2 cores. A file's tests stay in one worker (a module's fixtures start once, a chapter's
# cells share one kernel); each file of tests/system names its hosts and namespaces apart.
# The chapters that fit and compare measured times run alone, after.
TWO      = -n 2 --dist loadfile
TIMED    = notebooks/communication_efficiency.ipynb notebooks/inside_a_job.ipynb notebooks/scaling.ipynb
CHAPTERS = $(filter-out $(TIMED),$(wildcard notebooks/*.ipynb))

# every test, then every chapter re-executed and compared with its committed outputs,
# on this CPU's kernels and again as on another CPU
test: venv
	$(PY) -m pytest $(TWO) tests $(CHAPTERS) $(NBVAL)
	$(PY) -m pytest $(TIMED) $(NBVAL)
	$(OTHER_CPU) $(PY) -m pytest $(TWO) $(CHAPTERS) $(NBVAL)
	$(OTHER_CPU) $(PY) -m pytest $(TIMED) $(NBVAL)

# the job tests and the chapters on a busy machine: two processes spin beside them, so a
# check on a time, a rate or a fit that only holds on a quiet machine shows up here
test-load: venv
	$(PY) tests/under_load.py --busy 2 -- $(PY) -m pytest tests/jobs notebooks/*.ipynb $(NBVAL)

# one-process tests only (about a minute)
test-fast: venv
	$(PY) -m pytest tests/unit

test-jobs: venv
	$(PY) -m pytest tests/jobs

test-system: venv
	$(PY) -m pytest tests/system

# re-execute the chapters in place (after changing one), saving their outputs (no widget
# state); one chapter: $(PY) notebooks/run.py scaling.ipynb
notebooks: venv
	$(PY) notebooks/run.py

# the chapters' diagrams: notebooks/figures/*.svg, redrawn by the script beside them
figures: venv
	$(PY) notebooks/figures/draw.py

# the chapters' :label: and :numref: written as anchors and links (--check: change nothing)
refs: venv
	$(PY) book/refs.py

# the functions a student reads for one all-reduce and one push/pull, with their lines,
# written into ARCHITECTURE.md's "Read this first" (after changing one of them)
reading-path: venv
	$(PY) book/reading_path.py --write

# per notebook: words of prose (by its own rules and as wc -w counts), median sentence length,
# share of sentences over 40 words, against issue 50's targets (--check: exit 1 if one is missed)
prose: venv
	$(PY) book/prose.py

# the chapters (answers.ipynb last) as a static site, no kernel and no network needed:
# build/book/index.html, and the API reference from the docstrings (pdoc): build/book/api/
book: venv
	$(PY) book/build.py

benchmarks: venv
	$(PY) benchmarks/kvstore.py
	$(PY) benchmarks/allreduce.py
	$(PY) benchmarks/train_throughput.py
	$(PY) benchmarks/scaling.py
	$(PY) benchmarks/replicas.py

# on a machine with a GPU: the tests' CUDA cases and the Trainer against DDP there
gpu: venv
	PYTHON=$(PY) bash benchmarks/on_gpu.sh

clean:
	rm -rf $(VENV) .pytest_cache
