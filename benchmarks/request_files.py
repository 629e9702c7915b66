"""Which sobrio files one chat request runs code in (docs/architecture.md): a server in this process
(`--no-engine-process`, so the engine core's files count too), one warm-up request, then one
/v1/chat/completions request recorded with sys.setprofile/threading.setprofile on every thread.

    PYTHONPATH=$PWD python benchmarks/request_files.py $PWD     # prints the files by folder, then the count
"""

import collections
import os
import sys
import threading
import time

import httpx

ROOT = sys.argv[1]  # the tree whose sobrio/ is measured
PORT = 8391
seen: set[str] = set()
recording = threading.Event()


def prof(frame, event, arg):
    if recording.is_set() and event == "call":
        f = frame.f_code.co_filename
        if f.startswith(ROOT + "/sobrio/"):
            seen.add(f[len(ROOT) + 1:])


def serve():
    from sobrio.cli import main
    main(["serve", "smollm2-135m", "--no-engine-process", "--port", str(PORT), "--max-model-len", "512"])


threading.setprofile(prof)
sys.setprofile(prof)
threading.Thread(target=serve, daemon=True).start()
body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}
for _ in range(600):
    try:
        if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
httpx.post(f"http://127.0.0.1:{PORT}/v1/chat/completions", json=body, timeout=300).raise_for_status()
time.sleep(0.5)
recording.set()
httpx.post(f"http://127.0.0.1:{PORT}/v1/chat/completions", json=body, timeout=300).raise_for_status()
time.sleep(0.5)
recording.clear()
by_folder = collections.defaultdict(list)
for f in sorted(seen):
    by_folder[os.path.dirname(f)].append(os.path.basename(f))
for folder, files in sorted(by_folder.items()):
    print(f"{folder}/ ({len(files)}): {', '.join(files)}")
print(f"{len(seen)} files in {len(by_folder)} folders")
sys.stdout.flush()
os._exit(0)
