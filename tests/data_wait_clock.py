"""A fake clock, batches that take its time and the trainer's loop on it: the data-wait tests' stand-ins
(tests/test_data_wait.py, tests/launched/test_data_wait_two_ranks.py)."""


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class TimedBatches:
    """Yields len(seconds) batches; getting batch i takes seconds[i] on the fake clock (batch 0's includes
    the opening: workers starting); opening the epoch itself takes ``opening``, its end ``closing``."""

    def __init__(self, clock, seconds, opening=0.0, closing=0.0):
        self.clock, self.seconds, self.opening, self.closing = clock, seconds, opening, closing

    def __iter__(self):
        self.clock.now += self.opening
        for i, s in enumerate(self.seconds):
            self.clock.now += s
            yield i
        self.clock.now += self.closing


def train(meter, clock, epochs, compute, accum=1):
    """The trainer's loop on the fake clock: each micro-batch takes ``compute`` seconds of work."""
    micro = 0
    for epoch in epochs:
        for _ in meter.batches(lambda epoch=epoch: epoch):
            clock.now += compute
            micro += 1
            if micro % accum == 0:
                meter.step_ended()
                clock.now += 100.0  # logging, evaluation, saving between steps: in no step's time
