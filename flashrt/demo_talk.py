"""`flashrt demo --talk`: the toy robot narrates what it does while its policy keeps the control rate.

The demo's policy steps at ``rate_hz`` (a control lane of one `flashrt.Runtime`) and, every
``NARRATE_EVERY_S`` seconds, the loop hands a sentence about the arm's state to a speech thread (a
stream lane) that speaks it with a real voice (Piper's ``en_US-joe-medium`` from the test extra's
voice package, or any voice ``load_tts`` takes). The speech is written to a WAV; the report gives the
control loop's misses and slack, the speech's RTF and underruns, and the waits each caused the other.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

NARRATE_EVERY_S = 2.0
JOINTS = ("base", "shoulder", "elbow", "wrist pitch", "wrist roll", "wrist yaw", "gripper")


def narration(tick: int, before: np.ndarray, now: np.ndarray, rate_hz: float) -> str:
    """One sentence about what the arm did since the last one: the joint that moved most."""
    delta = now - before
    j = int(np.argmax(np.abs(delta)))
    way = "up" if delta[j] > 0 else "down"
    return (f"At {tick / rate_hz:.0f} seconds, the {JOINTS[j % len(JOINTS)]} moves {way} "
            f"to {now[j]:.2f} radians.")


def run_talking(policy: Any, robot_cls: Any, rate_hz: float, seconds: float, voice: str,
                wav: Path) -> dict[str, Any]:
    """The loop with narration (module docstring) -> the report (and the WAV written)."""
    from flashrt.runner.tts import load_tts, write_wav
    from flashrt.runtime.owner import Runtime

    tts = load_tts(voice)
    runtime = Runtime()
    arm = runtime.lane("policy", "control", rate_hz=rate_hz)
    mouth = runtime.lane("speech", "stream")
    runtime.adopt(policy, arm)
    runtime.adopt(tts, mouth)
    speaker = _Speaker(tts, mouth)
    robot = robot_cls()
    for _ in range(3):  # warm-up, not timed
        policy.infer(robot.observe(), seed=0)
    policy.reset()
    speaker.start()
    every = max(int(round(NARRATE_EVERY_S * rate_hz)), 1)
    last = robot.state.copy()
    for tick in arm.ticks(max(int(round(rate_hz * seconds)), 1)):
        with arm.call():
            robot.apply(policy.step(robot.observe()))
        if tick % every == every - 1:
            speaker.say(narration(tick + 1, last, robot.state, rate_hz))
            last = robot.state.copy()
    audio = speaker.finish()
    wav.parent.mkdir(parents=True, exist_ok=True)
    write_wav(wav, audio, tts.sample_rate)
    lanes = runtime.report()
    return {"rate_hz": rate_hz, "ticks": lanes["policy"]["calls"], "misses": lanes["policy"]["misses"],
            "slack_ms": lanes["policy"]["slack_ms"], "end_after_release_ms": lanes["policy"]["call_ms"],
            "sentences": speaker.sentences, "speech_s": len(audio) / tts.sample_rate,
            "speech_rtf": speaker.rtf(), "underruns": lanes["speech"]["underruns"],
            "policy_waited_for_speech_ms": lanes["policy"]["waited_for_ms"].get("speech", 0.0),
            "speech_waited_for_policy_ms": lanes["speech"]["waited_for_ms"].get("policy", 0.0),
            "wav": str(wav), "voice": voice, "errors": speaker.errors[:3]}


class _Speaker:
    """Speaks queued sentences on its own thread; keeps the audio (a short pause between sentences)."""

    def __init__(self, tts: Any, lane: Any) -> None:
        self.tts, self.lane = tts, lane
        self.sentences, self.errors, self.compute_s = 0, [], 0.0
        self._queue: queue.Queue = queue.Queue()
        self._audio: list[np.ndarray] = []
        self._thread = threading.Thread(target=self._run, name="flashrt-demo-speech", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def say(self, text: str) -> None:
        self._queue.put(text)

    def finish(self) -> np.ndarray:
        self._queue.put(None)
        self._thread.join(300)
        return np.concatenate(self._audio) if self._audio else np.zeros(0, dtype=np.float32)

    def _run(self) -> None:
        pause = np.zeros(int(0.3 * self.tts.sample_rate), dtype=np.float32)
        while (text := self._queue.get()) is not None:
            start = time.perf_counter()
            try:
                for chunk in self.tts.stream(text):
                    self.lane.played(chunk.shape[-1] / self.tts.sample_rate)
                    self._audio.append(np.asarray(chunk, dtype=np.float32).reshape(-1))
                self._audio.append(pause)
                self.sentences += 1
            except Exception as exc:  # noqa: BLE001 - reported; the robot keeps going
                self.errors.append(repr(exc))
            self.compute_s += time.perf_counter() - start
            self.lane.end_of_speech()

    def rtf(self) -> float | None:
        spoken = sum(a.shape[-1] for a in self._audio) / self.tts.sample_rate
        return self.compute_s / spoken if spoken else None
