"""Rank-0 output: progress bar on a terminal, plain lines elsewhere, JSON-lines metrics."""

from __future__ import annotations

import io
import json

import torch

from launcher.core.logging_utils import RankLog, parameter_sha256
from launcher.training.models import mlp


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_terminal(tmp_path):
    stream = io.StringIO()
    log = RankLog(True, tmp_path / "m.jsonl", stream)
    log.progress(5, 10, "loss 1.0")
    log.info("done")
    log.close()
    assert stream.getvalue() == "step 5/10 loss 1.0\ndone\n"


def test_progress_bar_on_a_terminal_is_redrawn_in_place():
    stream = Terminal()
    log = RankLog(True, None, stream)
    log.progress(5, 10, "loss 1.0")
    log.progress(10, 10, "loss 0.5")
    log.info("done")
    text = stream.getvalue()
    assert text.count("\r[") == 2 and "\n" not in text.split("done")[0][:-1]
    assert "[###############...............] 5/10" in text and text.endswith("\ndone\n")


def test_only_rank_0_writes(tmp_path):
    stream = io.StringIO()
    log = RankLog(False, tmp_path / "m.jsonl", stream)
    log.info("hello")
    log.progress(1, 2, "x")
    log.metrics({"event": "step"})
    log.close()
    assert stream.getvalue() == "" and not (tmp_path / "m.jsonl").exists()


def test_metrics_are_appended_as_json_lines(tmp_path):
    path = tmp_path / "run" / "m.jsonl"
    for step in (1, 2):
        log = RankLog(True, path, io.StringIO())
        log.metrics({"event": "step", "step": step, "loss": 0.5})
        log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all("time" in r for r in records)


def test_parameter_hash_sees_every_bit():
    torch.manual_seed(0)
    model = mlp()
    before = parameter_sha256(model)
    assert len(before) == 64 and before == parameter_sha256(model)
    with torch.no_grad():
        last = list(model.parameters())[-1]
        last.view(-1)[0] = torch.nextafter(last.view(-1)[0], torch.tensor(1.0))
    assert parameter_sha256(model) != before
