"""`tierkv replay --l3 redis://:PASSWORD@...` never shows the password: not in the table, the JSON report,
stderr or an error message. Shown specs carry `***` instead (as the storage errors already did)."""

import json
import logging
from pathlib import Path

import pytest

from tests.servers import RedisServer, free_port, running
from tierkv.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "conversation_200.jsonl"
SECRET = "pw-Zq81xK"


def _replay(l3: str, out: Path, *extra: str) -> int:
    return main(["replay", str(FIXTURE), "--limit", "30", "--l1-tokens", "4k", "--l2-tokens", "12k", "--l3", l3,
                 "--json", str(out), "--no-baselines", "--serial", *extra])


def _assert_masked(capsys, caplog, out: Path) -> dict:
    shown = capsys.readouterr()
    for text in (shown.out, shown.err, caplog.text, out.read_text()):
        assert SECRET not in text
    assert "redis://:***@127.0.0.1" in shown.out.replace("\n", "")
    report = json.loads(out.read_text())
    assert report["config"]["l3"].startswith("redis://:***@127.0.0.1:")
    return report


def test_password_is_masked_in_table_and_json_with_a_real_server(tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    with running(lambda: RedisServer.start(password=SECRET)) as server:
        assert SECRET in server.url
        out = tmp_path / "r.json"
        assert _replay(server.url, out) == 0
        report = _assert_masked(capsys, caplog, out)
        assert report["tokens_moved"]["l2_to_l3"] > 0  # the replay really used the authenticated store


@pytest.mark.parametrize("what", ["wrong password", "no server"])
def test_an_l3_that_cannot_be_used_is_refused_at_start_with_its_password_masked(tmp_path, capsys, caplog, what):
    """An L3 that cannot store and read a page is refused before the replay (it used to run with 0 L3 hits),
    in one line that shows the spec with its password masked."""
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "r.json"
    if what == "no server":
        rc = _replay(f"redis://:{SECRET}@127.0.0.1:{free_port()}/0", out)
    else:
        with running(lambda: RedisServer.start(password="the-right-one")) as server:
            rc = _replay(f"redis://:{SECRET}@127.0.0.1:{server.port}/0", out)
    shown = capsys.readouterr()
    assert rc == 2 and not out.exists()
    for text in (shown.out, shown.err, caplog.text):
        assert SECRET not in text
    err = shown.err.strip()
    assert err.count("\n") == 0 and "L3 redis://:***@127.0.0.1:" in err and "Traceback" not in err


def test_password_is_masked_in_config_errors(tmp_path, capsys):
    url = f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"
    rc = main(["replay", str(FIXTURE), "--limit", "5", "--l2-tokens", "0", "--l3", url])
    assert rc == 2
    err = capsys.readouterr().err
    assert "needs an L2 tier" in err and SECRET not in err and "***" in err


def test_a_db_index_the_server_refuses_is_a_one_line_error(tmp_path, capsys):
    with running(RedisServer.start) as server:
        url = server.url.rsplit("/", 1)[0] + "/99999"  # redis-server has 16 dbs by default
        assert _replay(url, tmp_path / "r.json") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "redis db 99999" in err and "Traceback" not in err
