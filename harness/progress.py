"""What a terminal shows while a run trains (a file or a pipe gets none of it)."""

import sys


class Progress:
    """On a terminal, stdout while a domain trains (with Progress(): ...): `show` writes a line that
    the next one overwrites; other output erases it first. A log file or a pipe gets none of it."""

    def __init__(self):
        self.stream, self.shown = sys.stdout, False

    def __enter__(self):
        if getattr(self.stream, "isatty", lambda: False)():
            sys.stdout = self

    def __exit__(self, *exc):
        if self.shown:
            self.show("")
        sys.stdout = self.stream

    def show(self, text):
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self.shown = bool(text)

    def write(self, text):
        if text and self.shown:
            self.show("")
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)
