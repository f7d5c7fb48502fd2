"""Telling the running ext_proc workers to reload: where they are and their admin token (from `llmgw up`'s
up.json or the command line), and the reload itself."""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path


def reload_workers(urls: list[str], revision: str, token: str, timeout_s: float = 10.0) -> list[str]:
    """POST /reload to each worker's status server, with the admin token; what did not end up serving
    `revision`."""
    failed = []
    for status in urls:
        base = status.rsplit("/status", 1)[0]
        deadline = time.monotonic() + timeout_s
        serving = ""
        while time.monotonic() < deadline:
            try:
                req = urllib.request.Request(f"{base}/reload", data=b"", method="POST",
                                             headers={"authorization": f"Bearer {token}"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    serving = str(json.loads(r.read()).get("revision"))
            except OSError as e:
                serving = f"unreachable ({e})"
            if serving == revision:
                break
            time.sleep(0.2)
        if serving != revision:
            failed.append(f"{base}: serves {serving}")
    return failed


def admin_token(args: argparse.Namespace) -> str:
    """The workers' admin token: --admin-token-file, else the one `llmgw up`'s up.json names ("" when
    neither: the workers then refuse the reload, and say so)."""
    path = args.admin_token_file
    if path is None:
        up = Path(args.state_dir) / "up.json"
        path = json.loads(up.read_text()).get("admin_token_file") if up.exists() else None
    return Path(path).read_text().strip() if path and Path(path).exists() else ""


def status_urls(args: argparse.Namespace) -> list[str]:
    """The workers' status URLs: --reload-url, else `llmgw up`'s up.json."""
    if args.reload_url:
        return list(args.reload_url)
    up = Path(args.state_dir) / "up.json"
    return list(json.loads(up.read_text()).get("extproc_status", [])) if up.exists() else []
