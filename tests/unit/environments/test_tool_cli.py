"""`megatron-rl tool python FILE`: the observation on stdout and exit 0 whatever the code
does; a bad path or option is one line on stderr and exit 2."""

import pytest

from megatron_rl.cli import main as cli_main


def _run(capsys, *argv):
    try:
        code = cli_main(["tool", *argv])
    except SystemExit as exit_info:  # argparse's own errors exit
        code = exit_info.code
    return code, capsys.readouterr()


def test_failing_code_prints_its_observation_and_exits_0(isolation, tmp_path, capsys):
    source = tmp_path / "solve.py"
    source.write_text("print(2**100)\nraise KeyError('x')\n")
    code, out = _run(capsys, "python", str(source), "--timeout", "2")
    assert code == 0
    assert out.out == "1267650600228229401496703205376\nerror: KeyError: 'x'\n"
    assert out.err.splitlines()[0] == isolation.line() and "status: error" in out.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["python", "{tmp}/missing.py"], "missing.py does not exist"),
        (["python", "{tmp}"], "is not a file"),
        (["python", "{tmp}/latin1.py"], "is not UTF-8 text"),
        (["python", "{tmp}/ok.py", "--timeout", "-1"], "--timeout -1: give seconds, 0 < S <= 600"),
        (["python", "{tmp}/ok.py", "--timeout", "601"], "--timeout 601: give seconds, 0 < S <= 600"),
        (["python", "{tmp}/ok.py", "--timeout", "abc"], "invalid float value: 'abc'"),
        (["python"], "the following arguments are required: FILE"),
        (["ruby", "{tmp}/ok.py"], "invalid choice: 'ruby'"),
    ],
)
def test_a_bad_path_or_option_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "ok.py").write_text("print(1)\n")
    (tmp_path / "latin1.py").write_bytes(b"print('caf\xe9')\n")
    code, out = _run(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert code == 2 and out.out == ""
    assert len(out.err.strip().splitlines()) == 1 and message in out.err, out.err
