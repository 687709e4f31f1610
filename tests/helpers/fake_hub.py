"""Hugging Face Hub repos served from local folders, offline, with every transfer recorded.

``snapshot_download`` copies the files its ``allow_patterns`` match into a cache laid out as
``huggingface_hub``'s (``models--org--name/snapshots/<commit>/``) and ``HfFileSystem`` lists a
repo and opens its files for ranged reads: the two entry points ``models.hub`` calls.
"""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, cache: Path, monkeypatch):
        self.cache, self.repos = Path(cache), {}
        self.downloaded: list[str] = []  # file names copied by snapshot_download, in order
        self.ranged: dict[str, int] = {}  # file name -> bytes read through HfFileSystem
        self.offline = False  # as HF_HUB_OFFLINE=1: the cached snapshot as it is, nothing fetched
        hub = self

        def snapshot_download(repo_id, revision=None, allow_patterns=None, **_):
            if repo_id not in hub.repos:
                raise RuntimeError(f"404: {repo_id}")
            assert revision in (None, "main", COMMIT), revision
            snap = hub.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
            if hub.offline:
                if not snap.is_dir():
                    raise RuntimeError(f"offline and {repo_id} is not in the cache")
                return str(snap)
            snap.mkdir(parents=True, exist_ok=True)
            for f in sorted(hub.repos[repo_id].iterdir()):
                wanted = allow_patterns is None or any(fnmatch.fnmatch(f.name, p) for p in allow_patterns)
                if f.is_file() and wanted and not (snap / f.name).exists():
                    shutil.copy(f, snap / f.name)
                    hub.downloaded.append(f.name)
            return str(snap)

        class HfFileSystem:
            def ls(self, path, detail=True, revision=None, **_):
                assert revision == COMMIT and detail
                return [{"name": f"{path}/{f.name}", "size": f.stat().st_size, "type": "file"}
                        for f in sorted(hub.repos[path].iterdir())]

            def open(self, path, mode="rb", revision=None, block_size=None, **_):
                assert revision == COMMIT and mode == "rb"
                repo, name = path.rsplit("/", 1)
                return _Counting(open(hub.repos[repo] / name, "rb"), name, hub.ranged)

        # `datasets` binds huggingface_hub.HfFileSystem when it is first imported: imported here, under the
        # patch, it would keep the stand-in for the rest of the session (later tests: "no attribute _cache").
        import datasets  # noqa: F401

        monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
        monkeypatch.setattr("huggingface_hub.HfFileSystem", HfFileSystem)

    def add(self, repo_id: str, folder: Path) -> None:
        self.repos[repo_id] = Path(folder)

    def downloaded_weights(self) -> set[str]:
        return {f for f in self.downloaded if f.endswith(".safetensors")}


class _Counting:
    """A read-only file that adds the bytes read to ``counts[name]``."""

    def __init__(self, fh, name: str, counts: dict):
        self.fh, self.name, self.counts = fh, name, counts

    def read(self, n=-1):
        data = self.fh.read(n)
        self.counts[self.name] = self.counts.get(self.name, 0) + len(data)
        return data

    def seek(self, offset, whence=0):
        return self.fh.seek(offset, whence)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()
