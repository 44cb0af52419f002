"""Text -> sentences of phonemes -> phoneme ids, the way Piper voices were trained.

The phonemizer is espeak-ng, taken from the ``piper-tts`` package (the ``tts`` extra): its
``piper.espeakbridge`` extension wraps libespeak-ng with the espeak-ng data bundled in the wheel, so
it needs no system espeak and produces exactly the phoneme strings Piper voices are trained and run
with (the same espeak build, the same clause/sentence API). Alternatives considered: ``piper-phonemize``
(the older binding, last release 2024, no wheels for newer Pythons) and generic ``phonemizer`` +
``espeakng-loader`` (a different espeak build and a different punctuation/clause treatment than
Piper's, so ids would drift from what the voice expects).

Languages espeak-ng cannot serve use piper-tts's own phonemizers, as piper does (`PIPER_G2P`, by the
voice config's ``phoneme_type``): "hebrew" (Nakdimon diacritics, bundled in piper-tts, then rule-based
IPA), "japanese" (OpenJTalk), "thai" (TLTK). Each needs its own package, named when missing, at load;
their phonemes are single code points in the voice's map, so the ids follow the rules below. "pinyin"
(Chinese) uses piper-tts's ChinesePhonemizer (the `zh` extra: g2pW's polyphone model run by onnxruntime,
BERT's Chinese tokenizer, unicode-rbnf for numbers). Piper downloads the g2pW model at first use; flashrt
never downloads at load: the model folder (``g2pW/`` holding ``g2pw.onnx``, piper's layout) is looked up
beside the voice, in the voices folders and the working directory (where piper puts it), and a voice
without it is refused with where to get it. Pinyin ids pad once per syllable group (after each tone and
pause), not after every phoneme, as piper's Chinese ``phonemes_to_ids`` does.

Rules (Piper's): espeak returns clauses with their terminator and an end-of-sentence flag; language
switch flags ``(en)`` are dropped; the terminator is kept as a phoneme, followed by a space after
``, : ;``; text is NFD-decomposed into code points; a sentence ends where espeak says one ends. Ids:
``^ _ (p _)* $`` with ``_`` (pad) after every phoneme, from the voice's ``phoneme_id_map``; phonemes
missing from the map are dropped (and logged); the voice's ``vowel_clusters`` are merged first.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.io.inputs import check_text_chars

log = logging.getLogger(__name__)

__all__ = ["Phonemizer", "EspeakPhonemizer", "TextPhonemizer", "PiperPhonemizer", "PinyinPhonemizer",
           "PhonemeMap", "phonemizer_for", "INSTALL_HINT", "PIPER_G2P", "PHONEME_TYPES", "REFUSED_TYPES",
           "G2PW_FOLDER", "G2PW_URL"]

PAD, BOS, EOS = "_", "^", "$"
INSTALL_HINT = "pip install 'flashrt[tts]' (it brings piper-tts, whose wheel bundles espeak-ng and its data)"
_LANG_FLAG = re.compile(r"\([^)]+\)")
_ESPEAK_LOCK = threading.Lock()  # espeak-ng is one global state per process
_ESPEAK_READY: list[bool] = []


class Phonemizer(Protocol):
    """Sentences of phonemes; `pad_after` is None when the pad id follows every phoneme (Piper's rule), else
    the phonemes a pad follows (Chinese: the ends of syllable groups)."""

    pad_after: frozenset[str] | None

    def sentences(self, text: str) -> list[list[str]]: ...


def _espeak() -> Any:
    try:
        from piper import espeakbridge
        from piper.phonemize_espeak import ESPEAK_DATA_DIR
    except ModuleNotFoundError:
        raise ConfigError(f"phonemizing text for a Piper voice needs espeak-ng: {INSTALL_HINT}") from None
    if not _ESPEAK_READY:
        espeakbridge.initialize(str(ESPEAK_DATA_DIR))
        _ESPEAK_READY.append(True)
    return espeakbridge


@dataclass
class EspeakPhonemizer:
    """espeak-ng phonemes per sentence for one espeak voice (e.g. ``en-us``); thread-safe."""

    voice: str
    vowel_clusters: frozenset[tuple[str, ...]] = frozenset()
    pad_after = None

    def __post_init__(self) -> None:
        """Checks at load that espeak-ng has the voice (a config naming an unknown one would otherwise
        load and then fail at every call). `sentences` sets the voice again before each use."""
        with _ESPEAK_LOCK:
            bridge = _espeak()
            try:
                bridge.set_voice(self.voice)
            except Exception as exc:  # the bridge raises a plain RuntimeError for unknown voices
                raise CheckpointError(f"voice config: espeak.voice {self.voice!r}: espeak-ng has no such "
                                      f"voice ({exc})") from None

    def sentences(self, text: str) -> list[list[str]]:
        with _ESPEAK_LOCK:
            bridge = _espeak()
            try:
                bridge.set_voice(self.voice)
            except Exception as exc:  # the bridge raises a plain RuntimeError for unknown voices
                raise ConfigError(f"espeak-ng has no voice {self.voice!r} ({exc})") from None
            clauses = bridge.get_phonemes(text)
        out, current = [], []
        for phonemes, terminator, end in clauses:
            clause = (
                _LANG_FLAG.sub("", phonemes) + terminator + (" " if terminator in (",", ":", ";") else "")
            )
            current.extend(unicodedata.normalize("NFD", clause))
            if end:
                out.append(_merge(current, self.vowel_clusters))
                current = []
        if current:
            out.append(_merge(current, self.vowel_clusters))
        return [s for s in out if s]


@dataclass(frozen=True)
class PiperG2P:
    """piper-tts's phonemizer of one ``phoneme_type``: its module and class, and what it needs."""

    module: str
    cls: str
    needs: str


PIPER_G2P: dict[str, PiperG2P] = {
    "hebrew": PiperG2P("piper.phonemize_hebrew", "HebrewPhonemizer",
                       "onnxruntime (pip install 'flashrt[onnx]'); piper-tts bundles its Nakdimon model"),
    "japanese": PiperG2P("piper.phonemize_japanese", "JapanesePhonemizer",
                         "pyopenjtalk-plus (pip install 'flashrt[ja]')"),
    "thai": PiperG2P("piper.phonemize_thai", "ThaiPhonemizer", "tltk and unicode-rbnf (pip install "
                     "'flashrt[th]')"),
}
REFUSED_TYPES: dict[str, str] = {}
PHONEME_TYPES = ("espeak", "text", *PIPER_G2P, "pinyin")
G2PW_FOLDER = "g2pW"  # piper's name for the folder of its Chinese polyphone model (beside its voices)
G2PW_URL = ("https://huggingface.co/datasets/rhasspy/piper-checkpoints/resolve/main/zh/zh_CN/_resources/"
            "g2pw.tar.gz")


class PiperPhonemizer:
    """Sentences of phonemes from piper-tts's own phonemizer of `kind` (`PIPER_G2P`); built at load, so
    a missing package is a ConfigError naming it then; thread-safe."""

    def __init__(self, kind: str) -> None:
        spec = PIPER_G2P[kind]
        try:
            self._g2p = getattr(importlib.import_module(spec.module), spec.cls)()
        except ModuleNotFoundError as exc:
            raise ConfigError(f"{kind} voices phonemize with piper-tts's {spec.cls}, which needs {spec.needs}"
                              f" (missing: {exc.name}; piper-tts itself: {INSTALL_HINT})") from None
        self._lock = threading.Lock()

    pad_after = None

    def sentences(self, text: str) -> list[list[str]]:
        with self._lock:
            found = self._g2p.phonemize(text)
        return [list(sentence) for sentence in found if sentence]


class PinyinPhonemizer:
    """Chinese voices: piper-tts's ChinesePhonemizer over the g2pW model found in `model_dirs` (the first
    holding ``g2pw.onnx``); never downloads. Built at load: a missing model or package is a ConfigError
    then, naming what to install or where to put the model. Thread-safe."""

    def __init__(self, model_dirs: Sequence[Path]) -> None:
        found = next((Path(d) for d in model_dirs if (Path(d) / "g2pw.onnx").is_file()), None)
        if found is None:
            raise ConfigError(
                f"Chinese (pinyin) voices need piper's g2pW model: none of {[str(d) for d in model_dirs]} "
                f"holds g2pw.onnx. flashrt does not download at load; unpack {G2PW_URL} into a folder named "
                f"{G2PW_FOLDER!r} beside the voice or in the voices folder (piper's own download puts it in "
                f"its working directory), or pass g2pw_dir")
        try:
            module = importlib.import_module("piper.phonemize_chinese")
        except ModuleNotFoundError as exc:
            raise ConfigError(f"Chinese voices phonemize with piper-tts's ChinesePhonemizer (missing: "
                              f"{exc.name}): pip install 'flashrt[zh]'") from None
        try:
            self._g2p = module.ChinesePhonemizer(found)
        except ModuleNotFoundError as exc:
            raise ConfigError(f"Chinese voices phonemize with piper-tts's ChinesePhonemizer (missing: "
                              f"{exc.name}): pip install 'flashrt[zh]'") from None
        except Exception as exc:  # onnxruntime, transformers' tokenizer lookup: many exception types
            why = f"{type(exc).__name__}: {exc}"
            raise ConfigError(f"the g2pW model in {found} did not load: {why}") from None
        self.pad_after = frozenset(module.GROUP_END_PHONEMES)
        self.model_dir = found
        self._lock = threading.Lock()

    def sentences(self, text: str) -> list[list[str]]:
        with self._lock:
            found = self._g2p.phonemize(text)
        return [list(sentence) for sentence in found if sentence]


@dataclass
class TextPhonemizer:
    """Voices whose "phonemes" are the text's code points (phoneme_type "text"): one sentence."""

    pad_after = None

    def sentences(self, text: str) -> list[list[str]]:
        chars = list(unicodedata.normalize("NFD", text))
        return [chars] if chars else []


def _merge(phonemes: Sequence[str], clusters: frozenset[tuple[str, ...]]) -> list[str]:
    """Greedy longest-first merge of the voice's known vowel clusters into single phonemes."""
    if not clusters:
        return list(phonemes)
    longest, out, i = max(len(c) for c in clusters), [], 0
    while i < len(phonemes):
        n = next(
            (
                n
                for n in range(min(longest, len(phonemes) - i), 1, -1)
                if tuple(phonemes[i : i + n]) in clusters
            ),
            1,
        )
        out.append("".join(phonemes[i : i + n]))
        i += n
    return out


@dataclass(frozen=True)
class PhonemeMap:
    """The voice's ``phoneme_id_map`` (phoneme -> ids) and where pads go: after every phoneme and after
    ``^`` (`pad_after` None, Piper's rule), or only after the phonemes in `pad_after` (Chinese)."""

    ids_of: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    pad_after: frozenset[str] | None = None

    @classmethod
    def from_voice(cls, voice_json: Mapping[str, Any], pad_after: frozenset[str] | None = None) -> PhonemeMap:
        table = voice_json.get("phoneme_id_map")
        if not table or any(k not in table for k in (PAD, BOS, EOS)):
            raise ConfigError("voice config: phoneme_id_map is missing or lacks '_', '^', '$'")
        return cls({k: tuple(int(i) for i in v) for k, v in table.items()}, pad_after)

    def _pad(self, phoneme: str) -> bool:
        return self.pad_after is None or phoneme in self.pad_after

    def __call__(self, phonemes: Iterable[str]) -> list[int]:
        pad, missing = self.ids_of[PAD], []
        out = [*self.ids_of[BOS], *(pad if self.pad_after is None else ())]
        for p in phonemes:
            ids = self.ids_of.get(p)
            if ids is None:
                missing.append(p)
                continue
            out += [*ids, *pad] if self._pad(p) else [*ids]
        if missing:
            log.warning("phonemes not in the voice's map, dropped: %s", sorted(set(missing)))
        return out + list(self.ids_of[EOS])


def phonemizer_for(voice_json: Mapping[str, Any], model_dirs: Sequence[Path] = ()) -> Phonemizer:
    """The phonemizer a Piper voice config asks for ("espeak" with its voice, "text", one of piper's own,
    `PIPER_G2P`, or "pinyin" with its g2pW model from the first of `model_dirs` that holds it)."""
    kind = voice_json.get("phoneme_type", "espeak")
    if kind == "text":
        return TextPhonemizer()
    if kind in PIPER_G2P:
        return PiperPhonemizer(kind)
    if kind == "pinyin":
        return PinyinPhonemizer(model_dirs)
    if kind != "espeak":
        why = REFUSED_TYPES.get(kind, "unknown")
        raise ConfigError(f"voice config: phoneme_type {kind!r}: {why}; supported: {list(PHONEME_TYPES)}")
    voice = voice_json.get("espeak", {}).get("voice")
    if not voice:
        raise ConfigError("voice config: espeak.voice is missing")
    clusters = frozenset(tuple(c) for c in voice_json.get("vowel_clusters") or ())
    return EspeakPhonemizer(voice, clusters)


def check_text(text: Any, limit: int) -> str:
    """A non-empty string of at most `limit` characters (InputError otherwise)."""
    if not isinstance(text, str):
        raise InputError(f"text: expected a string, got {type(text).__name__}")
    check_text_chars(text)
    if not text.strip():
        raise InputError("text: empty")
    if len(text) > limit:
        raise InputError(f"text: {len(text)} characters exceed the limit of {limit}")
    return text
