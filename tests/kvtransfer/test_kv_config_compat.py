"""Config files written before wire protocol 2 still load: `kv_transfer.verify_checksum` maps to
`kv_transfer.checksum` (true: always, false: never) with a deprecation warning; both together
are refused with a message saying which to keep."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.kvtransfer.config import KvTransferConfig


@pytest.mark.parametrize(("old", "new"), [(True, "always"), (False, "never")])
def test_old_verify_checksum_maps_to_checksum(old, new):
    with pytest.warns(DeprecationWarning, match="kv_transfer.checksum"):
        assert KvTransferConfig(verify_checksum=old).checksum == new


def test_default_checks_between_hosts_only():
    assert KvTransferConfig().checksum == "between_hosts"


def test_old_and_new_together_are_refused():
    with pytest.raises(ValidationError, match="set only checksum"):
        KvTransferConfig(verify_checksum=True, checksum="never")
