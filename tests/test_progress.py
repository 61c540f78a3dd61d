"""Progress bars: quiet unless stderr is a terminal or SPARTA_PROGRESS=1; never with SPARTA_PROGRESS=0."""

from sparta import progress


def test_progress_switch(monkeypatch):
    monkeypatch.setenv("SPARTA_PROGRESS", "0")
    assert not progress.enabled() and progress.bar("x", 3).disable
    monkeypatch.setenv("SPARTA_PROGRESS", "1")
    assert progress.enabled()
    monkeypatch.delenv("SPARTA_PROGRESS")
    assert progress.enabled() == progress.sys.stderr.isatty()


def test_bar_counts(monkeypatch, capsys):
    monkeypatch.setenv("SPARTA_PROGRESS", "1")
    with progress.bar("stage", 2) as b:
        b.update(2)
    assert "stage" in capsys.readouterr().err
