"""`splitserve keygen FILE ...`: new files get a fresh random key (mode 0600, parent folders
made) that the router's key loaders accept; existing files are kept byte for byte; no key is
ever printed; a FILE that cannot be written is one line and exit 1."""

from __future__ import annotations

import argparse
import os
import re
import stat

from splitserve.cli.keygen_cmd import new_key
from splitserve.cli.main import main
from splitserve.service.credentials import cluster_secret, load_keys


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_writes_new_keys_and_keeps_existing_ones(tmp_path, capsys):
    api, cluster = tmp_path / "api-keys", tmp_path / "deep" / "er" / "cluster-secret"
    old_umask = os.umask(0o022)  # a usual umask must not widen or narrow the files' mode
    try:
        assert main(["keygen", str(api), str(cluster)]) == 0
    finally:
        os.umask(old_umask)
    first = capsys.readouterr()
    keys = [p.read_text() for p in (api, cluster)]
    for path, text in zip((api, cluster), keys):
        assert re.fullmatch(r"ss-[A-Za-z0-9_-]{43}\n", text), text
        assert _mode(path) == 0o600
        assert text.strip() not in first.out + first.err
    assert keys[0] != keys[1]
    assert _mode(cluster.parent) == _mode(cluster.parent.parent) == 0o700
    assert first.out.splitlines() == [
        f"{api}: new key written (mode 0600)",
        f"{cluster}: new key written (mode 0600)",
    ]
    # what the router and the sidecars read
    assert load_keys(str(api), None) == (keys[0].strip(),)
    assert cluster_secret(str(cluster)) == keys[1].strip().encode()

    third = tmp_path / "admin-keys"
    assert main(["keygen", str(api), str(third)]) == 0
    again = capsys.readouterr()
    assert api.read_text() == keys[0]  # kept: clients holding it keep working
    assert third.read_text() not in keys
    assert again.out.splitlines() == [
        f"{api}: exists, kept",
        f"{third}: new key written (mode 0600)",
    ]


def test_no_key_starts_with_a_dash_so_api_key_flag_takes_it():
    # a bare token_urlsafe key starts with '-' one time in 64: `--api-key KEY` then fails
    # with "expected one argument" (a flaky CI run found it)
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key")
    for _ in range(2000):
        key = new_key()
        assert parser.parse_args(["--api-key", key]).api_key == key


def test_existing_file_readable_by_others_is_kept_with_a_hint(tmp_path, capsys):
    shared = tmp_path / "shared"
    shared.write_text("a-key-someone-wrote-by-hand\n")
    shared.chmod(0o644)
    assert main(["keygen", str(shared)]) == 0
    assert shared.read_text() == "a-key-someone-wrote-by-hand\n" and _mode(shared) == 0o644
    assert (
        capsys.readouterr().out.strip()
        == f"{shared}: exists, kept (readable by others: chmod 600 {shared})"
    )


def test_unwritable_file_is_one_line_and_the_others_still_written(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad, good = blocker / "key", tmp_path / "good"
    assert main(["keygen", str(bad), str(good)]) == 1
    out = capsys.readouterr()
    assert out.err.strip() == f"splitserve keygen: error: cannot write {bad}: Not a directory"
    assert out.out.strip() == f"{good}: new key written (mode 0600)" and good.is_file()
