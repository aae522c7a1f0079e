"""Checksums of a checkpoint iteration's files: `checksums.json` lists every other file under the iteration's
directory (path relative to it, size, sha256). It is written when a save is complete, before the directory gets
its final name, and verified before a resume reads anything but JSON from it, so that a damaged, truncated,
missing, changed or added file is named at start-up instead of failing (or silently loading) in the middle of a
load. Checksums guard against damage (a torn copy, a bad disk, a stray edit), not against someone who can rewrite
the directory, checksums.json included: what keeps a checkpoint from running code is `safe_load`.

Hashing reads every byte. Files are hashed in parallel threads (hashlib releases the GIL), one file per thread,
with a progress line every 30 s. Start-up verification hashes on one process (`full`: global rank 0); every other
rank checks only the names and sizes. A process remembers what it verified (names, sizes, modification times), so
the load right after the start-up check does not hash the same files again.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import time

CHECKSUMS_FILE = "checksums.json"
ALGORITHM = "sha256"
_CHUNK = 8 * 2**20
_PROGRESS_S = 30.0
_verified: dict[str, tuple] = {}  # iteration directory -> the file signature this process last verified in full


def list_files(root: str) -> list[str]:
    """Every file under `root` but checksums.json: relative paths with '/', sorted."""
    names = []
    for parent, dirs, files in os.walk(root):
        dirs.sort()
        for name in files:
            rel = os.path.relpath(os.path.join(parent, name), root).replace(os.sep, "/")
            if rel != CHECKSUMS_FILE:
                names.append(rel)
    return sorted(names)


def hash_files(root: str, names: list[str], label: str) -> dict[str, str]:
    """sha256 of each file `names` under `root`, in threads; a progress line (prefixed by `label`) every 30 s."""
    sizes = {n: os.path.getsize(os.path.join(root, n)) for n in names}
    total = sum(sizes.values())
    done = [0] * len(names)  # bytes hashed, one slot per file (written by its thread only)

    def digest(i: int, name: str) -> str:
        h = hashlib.sha256()
        with open(os.path.join(root, name), "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                done[i] += len(chunk)
        return h.hexdigest()

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(names)))) as pool:
        futures = {pool.submit(digest, i, n): n for i, n in enumerate(names)}
        pending = set(futures)
        while pending:
            _, pending = concurrent.futures.wait(pending, timeout=_PROGRESS_S)
            if pending:
                print(f"[megatron-rl] {label}: hashed {sum(done) / 2**30:.1f} of {total / 2**30:.1f} GiB in "
                      f"{time.monotonic() - start:.0f} s", flush=True)
        return {futures[f]: f.result() for f in futures}


def write_checksums(root: str, label: str) -> dict:
    """Write `root`/checksums.json for every file under `root` (atomically, flushed to disk). Returns a summary
    (files, bytes, seconds)."""
    start = time.monotonic()
    names = list_files(root)
    digests = hash_files(root, names, label)
    files = {n: {"size": os.path.getsize(os.path.join(root, n)), ALGORITHM: digests[n]} for n in names}
    path = os.path.join(root, CHECKSUMS_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"algorithm": ALGORITHM, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return {"files": len(names), "bytes": sum(e["size"] for e in files.values()),
            "seconds": time.monotonic() - start}


def read_checksums(root: str, flag: str) -> dict[str, dict]:
    """The files listed in `root`/checksums.json; errors name `flag` and the file."""
    path = os.path.join(root, CHECKSUMS_FILE)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{flag}: {root} has no {CHECKSUMS_FILE} (every iteration saved by this version has one, "
                         "written last: the directory is incomplete, or was copied without it)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: cannot read {path} ({e})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("algorithm") != ALGORITHM or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get(ALGORITHM), str)
            for e in files.values()):
        raise ValueError(f"{flag}: {path} is not a checksum list of this project ({ALGORITHM} and size per file)")
    return files


def verify_checksums(root: str, flag: str, full: bool = True) -> dict:
    """Check every file under `root` against its checksums.json: none missing, none added, each of its saved size,
    and (`full`) of its saved sha256. Raises a ValueError naming `flag`, the file and what differs. Returns a
    summary (files, bytes, seconds, hashed: whether this call hashed)."""
    start = time.monotonic()
    files = read_checksums(root, flag)
    present = list_files(root)
    missing = sorted(set(files) - set(present))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{flag}: {os.path.join(root, missing[0])} is missing{more}: it is listed in "
                         f"{CHECKSUMS_FILE}, the checkpoint is incomplete or damaged")
    extra = sorted(set(present) - set(files))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(f"{flag}: {os.path.join(root, extra[0])}{more} is not listed in {CHECKSUMS_FILE}: it was "
                         "added after the save; refused (remove it if it is yours)")
    signature = []
    for name in present:
        st = os.stat(os.path.join(root, name))
        if st.st_size != files[name]["size"]:
            raise ValueError(f"{flag}: {os.path.join(root, name)} has {st.st_size} bytes, {CHECKSUMS_FILE} says "
                             f"{files[name]['size']}: the file is damaged or was changed after the save")
        signature.append((name, st.st_size, st.st_mtime_ns, files[name][ALGORITHM]))
    key, signature = os.path.abspath(root), tuple(signature)
    hashed = full and _verified.get(key) != signature
    if hashed:
        digests = hash_files(root, present, f"{flag}: verifying {root}")
        for name in present:
            if digests[name] != files[name][ALGORITHM]:
                raise ValueError(f"{flag}: {os.path.join(root, name)} does not match its checksum ({ALGORITHM} "
                                 f"{digests[name][:16]}..., saved {files[name][ALGORITHM][:16]}...): the file is "
                                 "damaged or was changed after the save")
        _verified[key] = signature
    return {"files": len(present), "bytes": sum(s for _, s, _, _ in signature), "hashed": hashed,
            "seconds": time.monotonic() - start}
