"""A clock the test moves by hand (`now`, `sleep`): loop timing without waiting."""


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t

    def sleep(self, seconds):
        self.t += max(0.0, seconds)
