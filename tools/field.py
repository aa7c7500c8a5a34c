"""lnn-field: the offline desktop app for a plant-health station (Tk), with a --cli mode for scripts.

    lnn-field                                  # the window, with the bundled tomato-leaf model
    lnn-field leaf.jpg more_leaves/            # the window, checking these photos (a folder: its photos)
    lnn-field --model other.bin                # the window, with another model
    lnn-field --cli leaf.jpg more_leaves/      # no window: prints the answers exactly as lnn-infer does

In the window a station worker opens one photo, several, or a folder; each photo is shown with the
disease in words, the confidence, the top 3 and the advice line, or "uncertain" when the best answer
is under the model's threshold. Every answer joins the session's history, which "Save report…"
writes to a CSV file. Nothing needs a network.

--cli takes lnn-infer's arguments (IMAGE|DIR..., --model, --top-k, --json, --csv, --device, --threads)
and gives its output and exit status, so the packaged app can be scripted and tested without a display.
"""

from __future__ import annotations

import sys

from lnn.tools.cli import command_parser, run_command

PROG = "lnn-field"
CLI_FLAG = "--cli"


def build_parser():
    parser = command_parser(PROG, __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument(CLI_FLAG, action="store_true",
                        help="no window: classify the images that follow, printing like lnn-infer (see lnn-infer --help)")
    parser.add_argument("--model", metavar="M.bin", help="the model to start with (default: the bundled tomato-leaf model)")
    parser.add_argument("photos", nargs="*", metavar="PHOTO|DIR", help="photos (or folders of photos) to check at once")
    return parser


def open_window(args) -> int:
    from lnn.tools.field_ui import run_app      # Tk is imported only for the window

    return run_app(args.model, args.photos)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if CLI_FLAG in argv:                         # everything else on the line is lnn-infer's
        from lnn.tools import infer

        argv.remove(CLI_FLAG)
        return infer.main(argv, prog=PROG)     # its errors say lnn-field:
    return run_command(build_parser(), open_window, argv)


if __name__ == "__main__":
    sys.exit(main())
