"""The files of an index folder, and the JSON record of how the index was built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from retrieval.index.shards import atomic_write_bytes

FORMAT = "retrieval-index/1"


class IndexLayout:
    """INDEX_DIR/catalogue.sqlite, shards/shard-NNNNNN.npz, index.faiss, index.json."""

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory).expanduser()
        self.catalogue = self.root / "catalogue.sqlite"
        self.shards = self.root / "shards"
        self.faiss = self.root / "index.faiss"
        self.info = self.root / "index.json"

    def require_finished(self) -> None:
        if not self.catalogue.is_file():
            raise FileNotFoundError(
                f"{self.root} is not an index folder (no catalogue.sqlite); "
                "build one with `retrieval index build`"
            )
        if not self.info.is_file() or not self.faiss.is_file():
            raise FileNotFoundError(
                f"the index in {self.root} is not finished (an interrupted build?); run the "
                "same `retrieval index build` command again to finish it"
            )

    def read_info(self) -> dict[str, Any]:
        info = json.loads(self.info.read_text())
        if info.get("format") != FORMAT:
            raise ValueError(f"{self.info} has format {info.get('format')!r}, expected {FORMAT!r}")
        return info

    def write_info(self, info: dict[str, Any]) -> None:
        atomic_write_bytes(self.info, (json.dumps({"format": FORMAT, **info}, indent=2) + "\n").encode())

    def size_on_disk(self) -> dict[str, int]:
        def size(path: Path) -> int:
            return path.stat().st_size if path.is_file() else 0

        catalogue = sum(size(p) for p in self.root.glob("catalogue.sqlite*"))
        shards = sum(size(p) for p in self.shards.glob("*.npz")) if self.shards.is_dir() else 0
        out = {"catalogue": catalogue, "shards": shards, "faiss": size(self.faiss), "info": size(self.info)}
        out["total"] = sum(out.values())
        return out
