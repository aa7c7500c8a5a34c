"""tools/cli.py's run_command: every failure a person can meet is one line and an exit status."""

from lnn.tools.cli import command_parser, run_command


def test_running_out_of_memory_anywhere_is_one_line(capsys):
    def body(args):
        raise MemoryError("Unable to allocate 578. GiB for an array with shape (100000000, 1568)")

    assert run_command(command_parser("lnn-x", "test"), body, []) == 1
    captured = capsys.readouterr()
    assert captured.err == ("lnn-x: error: out of memory (Unable to allocate 578. GiB for an array with shape "
                            "(100000000, 1568)): give it less at once (a smaller --batch, fewer or smaller inputs)\n")
