# cohere-transcribe-coreml: the two README commands are `make demo` and `make test`.
# Both bootstrap `uv` (python3 -m pip install uv) when it is missing, then sync the locked environment.
SHELL := /bin/bash
PYTHON ?= python3
UV := $(shell command -v uv 2>/dev/null)
ifeq ($(UV),)
UV := $(PYTHON) -m uv
endif
RUN := $(UV) run --frozen
# Swift toolchain: `swift` on PATH, else the toolchain at /opt/swift (the machines' install location)
SWIFT ?= $(shell command -v swift 2>/dev/null || { [ -x /opt/swift/usr/bin/swift ] && echo /opt/swift/usr/bin/swift; })
SWIFT_FIXTURES ?= out/swift-fixtures
# seeded corpus of mutated manifests for the Swift fuzz test (tools/data/make_fuzz_manifests.py; docs/reliability.md)
FUZZ_MANIFESTS ?= out/fuzz-manifests
# torch threads of the Python processes the Swift step starts (fixtures, the interpreter child)
SWIFT_TEST_THREADS ?= 2

# export settings (override on the command line: make export MODEL=/path/to/checkpoint OUT=out/f16)
# default bundle folder: f16/ at the repository root (contents git-ignored), then `make quantize` -> q8/
MODEL ?=
OUT ?= f16
PRECISION ?= fp16

.PHONY: help bootstrap sync system-deps demo test test-fast lint swift-test swift-fixtures export quantize verify bench upload bundle-check clean

help:
	@echo "make demo      main job on the built-in default checkpoint"
	@echo "make test      run the test suite (ruff, then pytest and beside it the Swift package: make swift-test)"
	@echo "make system-deps  espeak-ng for the synthetic-speech tests (apt-get, as root; part of make test)"
	@echo "make test-fast the inner loop: ruff and the fast Python tests (under 2 minutes)"
	@echo "make export    MODEL=<hub id|folder> OUT=<dir> PRECISION=fp16|fp32: export Core ML packages"
	@echo "make verify    MODEL=<hub id|folder> OUT=<bundle dir> AUDIO='a.wav b.wav' LANGUAGES=en,de: parity report"
	@echo "make quantize  BUNDLE=f16 QOUT=q8 PRESET=q8|q8-hybrid|q4|q8a8|lowrank|q8-lowrank MODEL=<ckpt>: compress an exported bundle, gated"
	@echo "make upload    BUNDLE=q8 REPO_ID=org/name [DRY_RUN=1]: verify checksums, upload to the Hub"
	@echo "make bench     BENCH_BUNDLES='out/f16 out/q8' BENCH_DATA=<folder>: PyTorch vs bundles, WER/speed/memory -> out/bench"

bootstrap:
	@command -v uv >/dev/null 2>&1 || $(PYTHON) -m uv --version >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet uv

# --compile-bytecode: the environment's modules compiled once here, not at every import of every
# process: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) nothing else writes them,
# and every fresh `import coremltools` would compile them again
sync: bootstrap
	$(UV) sync --frozen --compile-bytecode

# demo: export the built-in default checkpoint (encoder + front end + stateful decoder + manifest), then transcribe
# the committed sample clips through the MIL interpreter and print texts and parity figures vs PyTorch.
# The verify report goes beside the bundle (<bundle>.verify.json), not into it: the manifest checksums
# every file of the bundle folder, so a report rewritten inside it broke the bundle on the next run.
DEMO_OUT ?= out/demo
# in-domain: the default model's own held-out speech (voices and commands it never trained on), where
# identical tokens are the expected result; out-of-domain: clips in its languages (it was trained on
# en/de/es only) in other voices and lengths, where small margins make near-ties (labelled, with margins)
DEMO_IN_DOMAIN ?= tests/data/heldout/en_heldout_00000.flac tests/data/heldout/de_heldout_00000.flac tests/data/heldout/es_heldout_00000.flac
DEMO_IN_DOMAIN_LANGUAGES ?= en,de,es
# out-of-domain clips (files in tests/data/audio; also the Swift fixtures' demo clips) and their languages
DEMO_CLIPS ?= en_medium.wav de_medium.wav es_medium.wav en_long_75s.flac
DEMO_LANGUAGES ?= en,de,es,en
comma := ,
empty :=
space := $(empty) $(empty)
DEMO_TAGS = $(subst $(space),$(comma),$(strip $(foreach c,$(DEMO_IN_DOMAIN),in-domain) $(foreach c,$(DEMO_CLIPS),out-of-domain)))
DEMO_MAX_NEW_TOKENS ?= 96
# words printed with their start, end and probability when the demo bundle has word alignment
DEMO_WORDS ?= 5

demo: sync
	@set -e; model=$$($(RUN) cohere-coreml prepare-default | tail -n 1); \
	out="$(DEMO_OUT)/$$(basename "$$model")-$(PRECISION)"; \
	echo "== default checkpoint: $$model -> $$out"; \
	$(RUN) cohere-coreml export --model "$$model" --out "$$out" --precision $(PRECISION); \
	$(RUN) cohere-coreml verify --model "$$model" --bundle "$$out" --backend mil \
		--max-new-tokens $(DEMO_MAX_NEW_TOKENS) --out "$$out.verify.json" \
		--audio $(DEMO_IN_DOMAIN) $(addprefix tests/data/audio/,$(DEMO_CLIPS)) --languages $(DEMO_IN_DOMAIN_LANGUAGES),$(DEMO_LANGUAGES) \
		--tags $(DEMO_TAGS); \
	if grep -q '"function": "align"' "$$out/manifest.json"; then \
		echo "== word timings (first $(DEMO_WORDS) words of $(firstword $(DEMO_IN_DOMAIN)))"; \
		$(RUN) cohere-coreml transcribe $(firstword $(DEMO_IN_DOMAIN)) --bundle "$$out" --backend mil \
			--language $(firstword $(subst $(comma), ,$(DEMO_IN_DOMAIN_LANGUAGES))) --word-timestamps \
			| sed -n '2,$(shell echo $$(($(DEMO_WORDS) + 1)))p'; \
	else echo "== no word timings: the bundle has no alignment (manifest decoder.alignment_note)"; fi; \
	$(RUN) cohere-coreml ane-check "$$out" --summary

# the suite on parallel workers (pytest-xdist; auto = one per CPU), each test file on one worker so its
# module fixtures are built once; session fixtures are shared between workers (tests/shared_builds.py).
# PYTEST_WORKERS=0 runs it in one process. The Swift step (make swift-test) runs beside pytest, not
# after it: much of it is one process at a time (fixture children, one interpreter child), so alone it
# leaves a core idle; its output goes to out/swift-test.log, printed in full when it fails.
# (`make -n test` runs both: GNU make executes a recipe line that holds $(MAKE) even under -n.)
# OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE unless set): an idle torch thread otherwise
# spins, and beside pytest the spinning takes the cores the workers need (the Swift tests' interpreter
# child with 2 threads: 49 -> 31 CPU-s for the same test; results do not depend on the wait policy).
PYTEST_WORKERS ?= auto
PYTEST_ARGS ?=
SWIFT_LOG ?= out/swift-test.log
test: sync lint system-deps
	$(RUN) python -m compileall -q src tools tests exports
	@mkdir -p $(dir $(SWIFT_LOG)); export OMP_WAIT_POLICY="$${OMP_WAIT_POLICY:-PASSIVE}"; \
	echo "make test: pytest, and beside it the Swift step (make swift-test; log: $(SWIFT_LOG))"; \
	$(MAKE) --no-print-directory swift-test SWIFT_NICE=0 > $(SWIFT_LOG) 2>&1 & swift=$$!; \
	trap 'kill $$swift 2>/dev/null' INT TERM; \
	py=0; $(RUN) pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS) || py=$$?; \
	echo "make test: pytest exit $$py; waiting for the Swift step"; \
	sw=0; wait $$swift || sw=$$?; \
	if [ $$sw -ne 0 ]; then cat $(SWIFT_LOG); \
	else grep -m 1 -E "SKIPPED|Build complete" $(SWIFT_LOG); grep -E "Executed [0-9]+ tests" $(SWIFT_LOG) | tail -n 1; fi; \
	echo "make test: pytest exit $$py, Swift step exit $$sw"; \
	[ $$py -eq 0 ] && [ $$sw -eq 0 ]

# system-deps: the Debian package espeak-ng (its command line and libespeak-ng), which the synthetic-speech and
# word-timing tests need (they skip without it): installed where it is missing when this is root with apt-get
# (CI: .ci/run), else one line saying the tests will skip and how to install it. SYSTEM_DEPS=skip: neither.
SYSTEM_DEPS ?= install
system-deps:
	@if [ "$(SYSTEM_DEPS)" = skip ] || command -v espeak-ng >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "make system-deps: installing espeak-ng (apt-get) for the synthetic-speech tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng >/dev/null \
			|| { echo "make system-deps: apt-get could not install espeak-ng (make test SYSTEM_DEPS=skip runs without it)"; exit 1; }; \
	else \
		echo "make system-deps: espeak-ng is not installed, so the synthetic-speech tests will skip (install it: sudo apt-get install espeak-ng, or brew install espeak-ng)"; \
	fi

# lint: ruff with the rule set in pyproject.toml ([tool.ruff.lint]); part of `make test`
lint: sync
	$(RUN) ruff check src tools tests exports

# test-fast: the inner loop (under 2 minutes here): lint, then the tests not marked slow in the modules
# that need no exported bundle (FAST_TESTS); `make test` runs everything
FAST_TESTS ?= tests/evaluation/test_metrics.py tests/model/test_tokens.py tests/model/test_shapes.py \
	tests/export/test_parity.py tests/storage/test_files.py tests/export/test_memory.py tests/model/test_checkpoint.py \
	tests/model/test_audio.py tests/bundle/test_fuzz_manifest.py tests/quantize/test_recipes.py \
	tests/swift/test_swift_package.py tests/runtime/test_ops.py tests/test_layout.py tests/test_tools_layout.py
test-fast: sync lint
	$(RUN) pytest -q -m "not slow" $(FAST_TESTS)

# The Swift package (Package.swift, swift/): reference data from the Python pipeline (cached under
# $(SWIFT_FIXTURES)), then build and `swift test`. Skipped with a message when no Swift toolchain exists.
# The suite is XCTest: Swift Testing is disabled so the run does not close on its empty "0 tests" line.
# The tests run on an optimised build (SWIFT_BUILD_FLAGS: release, with -enable-testing for @testable
# imports): the debug build's front end, SHA-256 and manifest checks took 428 s of tests, release 190 s.
# The build runs beside the fixtures (it needs none), its output in $(SWIFT_BUILD_LOG).
SWIFT_BUILD_FLAGS ?= -c release -Xswiftc -enable-testing
SWIFT_BUILD_LOG ?= out/swift-build.log
# niceness of the Swift step's processes (10: a machine shared with other work; make test passes 0)
SWIFT_NICE ?= 10
swift-fixtures: sync
	nice -n $(SWIFT_NICE) $(RUN) python tools/data/make_swift_fixtures.py --out $(SWIFT_FIXTURES) --threads $(SWIFT_TEST_THREADS) \
		--demo-clips $(DEMO_CLIPS) --demo-languages $(DEMO_LANGUAGES)
	nice -n $(SWIFT_NICE) $(RUN) python tools/data/make_fuzz_manifests.py --manifest $(SWIFT_FIXTURES)/bundle/manifest.json --out $(FUZZ_MANIFESTS)

swift-test:
	@if [ -z "$(SWIFT)" ]; then echo "make swift-test: SKIPPED: no Swift toolchain (swift not on PATH, no /opt/swift)"; exit 0; fi; \
	set -e; mkdir -p $(dir $(SWIFT_BUILD_LOG)); \
	export PATH="$$(dirname "$(SWIFT)"):$$PATH" COHERE_SWIFT_FIXTURES="$(abspath $(SWIFT_FIXTURES))" \
		COHERE_SWIFT_THREADS="$(SWIFT_TEST_THREADS)" COHERE_FUZZ_MANIFESTS="$(abspath $(FUZZ_MANIFESTS))"; \
	echo "swift build --build-tests $(SWIFT_BUILD_FLAGS) beside the fixtures (log: $(SWIFT_BUILD_LOG))"; \
	nice -n $(SWIFT_NICE) "$(SWIFT)" build --build-tests $(SWIFT_BUILD_FLAGS) > $(SWIFT_BUILD_LOG) 2>&1 & build=$$!; \
	trap 'kill $$build 2>/dev/null' EXIT; \
	$(MAKE) --no-print-directory swift-fixtures; \
	if ! wait $$build; then cat $(SWIFT_BUILD_LOG); echo "make swift-test: swift build failed"; exit 1; fi; \
	trap - EXIT; tail -n 1 $(SWIFT_BUILD_LOG); \
	nice -n $(SWIFT_NICE) "$(SWIFT)" test --skip-build $(SWIFT_BUILD_FLAGS) --disable-swift-testing

export: sync
	model="$(MODEL)"; [ -n "$$model" ] || model=$$($(RUN) cohere-coreml prepare-default | tail -n 1); \
	$(RUN) cohere-coreml export --model "$$model" --out "$(OUT)" --precision $(PRECISION) && \
	$(RUN) cohere-coreml bundle finalize "$(OUT)"

# verify: stage-by-stage parity of an exported bundle (OUT) against its checkpoint (MODEL), on AUDIO.
AUDIO ?= tests/data/audio/en_medium.wav tests/data/audio/de_medium.wav tests/data/audio/es_medium.wav
LANGUAGES ?= en,de,es

verify: sync
	model="$(MODEL)"; [ -n "$$model" ] || model=$$($(RUN) cohere-coreml prepare-default | tail -n 1); \
	$(RUN) cohere-coreml verify --model "$$model" --bundle "$(OUT)" --audio $(AUDIO) --languages $(LANGUAGES)

# quantize: f16/ -> q8/ at the repository root by default (issue 12); MODEL is only used by the
# held-out gate (greedy tokens / WER vs PyTorch; default: the built-in default checkpoint).
BUNDLE ?= f16
QOUT ?= q8
PRESET ?= q8
REPO_ID ?=
DRY_RUN ?=
# held-out set of the default model (greedy tokens / WER gate, `quantize --data`); EVAL_SET=none skips that gate
EVAL_SET ?= tests/data/heldout
# the larger held-out set evaluated while the held-out verdict on EVAL_SET is undecided (`quantize --more-data`)
MORE_EVAL_SET ?= tests/data/heldout-varied/single

quantize: sync
	model="$(MODEL)"; [ -n "$$model" ] || model=$$($(RUN) cohere-coreml prepare-default | tail -n 1); \
	more=""; [ "$(EVAL_SET)" = none ] || [ -z "$(MORE_EVAL_SET)" ] || more="--more-data $(MORE_EVAL_SET)"; \
	$(RUN) cohere-coreml quantize --bundle "$(BUNDLE)" --out "$(QOUT)" --preset $(PRESET) --model "$$model" \
		--data "$(EVAL_SET)" $$more

bundle-check: sync
	$(RUN) cohere-coreml bundle check "$(BUNDLE)"

upload: sync
	@[ -n "$(REPO_ID)" ] || { echo "make upload: set REPO_ID=org/name (and BUNDLE=f16|q8)"; exit 2; }
	$(RUN) cohere-coreml upload --bundle "$(BUNDLE)" --repo-id "$(REPO_ID)" $(if $(DRY_RUN),--dry-run,)


# bench: the default model in PyTorch and its bundle(s) (exported to out/ when missing) on the held-out set.
BENCH_DATA ?= tests/data/heldout
BENCH_BUNDLES ?=
BENCH_BACKEND ?= auto
BENCH_ARGS ?=
BENCH_OUT ?= out/bench

bench: sync
	@set -e; model=$$($(RUN) cohere-coreml prepare-default | tail -n 1); \
	bundles="$(BENCH_BUNDLES)"; \
	if [ -z "$$bundles" ]; then bundles="$(DEMO_OUT)/$$(basename "$$model")-$(PRECISION)"; \
		[ -f "$$bundles/manifest.json" ] || $(RUN) cohere-coreml export --model "$$model" --out "$$bundles" --precision $(PRECISION); fi; \
	$(RUN) cohere-coreml bench --pytorch "$$model" $$(for b in $$bundles; do printf -- '--bundle %s ' "$$b"; done) \
		--data $(BENCH_DATA) --backend $(BENCH_BACKEND) --out $(BENCH_OUT) $(BENCH_ARGS)

clean:
	rm -rf out .pytest_cache
