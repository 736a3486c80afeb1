"""What a terminal shows while a run trains (a file or a pipe gets none of it): the line updated
every round, and the pace and time left that it and the evaluation lines give."""

import sys
import time

import torch


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


class Pace:
    """Seconds spent on a domain (counting those before a --resume), and the pace and ETA of a
    round."""

    def __init__(self, start, spent, rounds, remaining):
        self.start, self.spent = start, spent            # the first round trained here; seconds
        self.rounds, self.remaining = rounds, remaining  # rounds a domain; domains after this one
        self.t0 = time.perf_counter()

    def seconds(self, device):
        if device.type == "cuda":
            torch.cuda.synchronize()
        return self.spent + time.perf_counter() - self.t0

    def __call__(self, t):
        rate = (time.perf_counter() - self.t0) / (t - self.start + 1)
        s = int(rate * (self.rounds - t + self.remaining * self.rounds))   # the ETA in seconds
        eta = f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
        return f"{rate:.2f} s/round | ETA {eta}"
