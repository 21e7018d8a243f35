"""Real llama.cpp servers for the routing benchmark, with nothing downloaded but
the source: ``llama-server`` built from the PyPI source distribution of
``llama-cpp-python`` (which vendors llama.cpp), a random-weight GGUF model
written here with ``numpy`` and ``gguf``, and replicas started cold.

    server = find_or_build_server(cache_dir)   # built once, kept in cache_dir
    model = write_model(cache_dir / "tiny.gguf")
    with replicas(server, model, n=3, ctx=12288, cache_ram_mib=128, slot_similarity=0, ...) as ports: ...

The build is CPU only, only the server target, niced and ``-j1`` by default
(``IOPD_BENCH_JOBS``): it takes a while once and is reused after.  The model
is a llama architecture of a few million parameters with a sentencepiece
vocabulary llama.cpp accepts: the control tokens, the 256 byte tokens (so
any text tokenizes), the printable ASCII characters, and a ChatML chat
template; about one token per character of ASCII text.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

__all__ = ["find_or_build_server", "replicas", "write_model"]

SDIST = "llama-cpp-python"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        done = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"bench_routing: `{cmd[0]} {cmd[1]}` failed (rc {done.returncode}); see {log}")


def find_or_build_server(cache_dir: Path, explicit: str | None = None) -> Path:
    """``explicit``, else ``llama-server`` on PATH, else the one built in ``cache_dir``
    (built now from the source distribution when missing)."""
    if explicit:
        return Path(explicit)
    built = cache_dir / "build" / "bin" / "llama-server"
    if built.exists():
        return built
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    log = cache_dir / "build.log"
    sources = sorted(cache_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not sources:
        archives = sorted(cache_dir.glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            print(f"bench_routing: fetching the {SDIST} source distribution", flush=True)
            pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
            _run([*pip, SDIST, "-d", str(cache_dir)], log)
            archives = sorted(cache_dir.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archives[-1]) as tar:
            tar.extractall(cache_dir, filter="data")
        sources = sorted(cache_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    source = sources[-1]
    print(
        f"bench_routing: building llama-server from {source.parent.parent.name} (once; log: {log})",
        flush=True,
    )
    options = [
        "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
        "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
        "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
    ]  # fmt: skip
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    build = cache_dir / "build"
    _run(["nice", "-n", "19", "cmake", "-S", str(source), "-B", str(build), *generator,
          *options], log)  # fmt: skip
    jobs = os.environ.get("IOPD_BENCH_JOBS", "1")
    _run(["nice", "-n", "19", "cmake", "--build", str(build), "--target", "llama-server",
          "-j", jobs], log)  # fmt: skip
    return built


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]  # unknown, control, control
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256  # byte
    tokens += ["\u2581"] + [chr(c) for c in range(33, 127)]
    tokens += ["\u2581" + chr(c) for c in range(ord("a"), ord("z") + 1)]
    types += [1] * (len(tokens) - len(types))  # normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, scores, types


def write_model(
    path: Path,
    *,
    n_embd: int = 256,
    n_layer: int = 4,
    n_head: int = 4,
    n_ff: int = 768,
    ctx: int = 32768,
    seed: int = 0,
) -> Path:
    """A random-weight llama GGUF (f32, a few million parameters); kept if present."""
    if path.exists():
        return path
    try:
        import gguf
        import numpy as np
    except ImportError:
        sys.exit("bench_routing: needs numpy and gguf: .venv/bin/pip install -e '.[bench]'")
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("iopd-bench-random")
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    def weight(*shape: int) -> object:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", weight(n_vocab, n_embd))
    for i in range(n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(b + name + ".weight", weight(n_embd, n_embd))
        w.add_tensor(b + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(b + "ffn_gate.weight", weight(n_ff, n_embd))
        w.add_tensor(b + "ffn_up.weight", weight(n_ff, n_embd))
        w.add_tensor(b + "ffn_down.weight", weight(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"bench_routing: llama-server exited (rc {proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"bench_routing: llama-server on port {port} not healthy in {timeout:g}s; see {log}")


@contextlib.contextmanager
def replicas(
    server: Path,
    model: Path,
    *,
    n: int,
    ctx: int,
    cache_ram_mib: int,
    slot_similarity: float = 0.1,
    threads: int,
    log_dir: Path,
    timeout: float = 120.0,
) -> Iterator[list[int]]:
    """``n`` cold ``llama-server`` replicas, one slot each, a bounded prompt cache
    (``slot_similarity`` 0: every new prompt saves the slot's prompt there and
    restores the best cached one); their ports.  Stopped (TERM, then KILL) on leaving."""
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        for i in range(n):
            port = _free_port()
            log = log_dir / f"replica-{i}.log"
            cmd = [
                str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "--alias", "bench", "-np", "1", "-c", str(ctx), "-t", str(threads),
                "-tb", str(threads), "--cache-ram", str(cache_ram_mib),
                "--slot-prompt-similarity", str(slot_similarity), "--no-warmup",
                "--no-webui", "-b", "2048", "-ub", "512",
            ]  # fmt: skip
            with log.open("wb") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
            ports.append(port)
        for port, proc, i in zip(ports, procs, range(n), strict=True):
            _wait_healthy(port, proc, log_dir / f"replica-{i}.log", timeout)
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
