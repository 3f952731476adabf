"""Stop sequences (Chat Completions' ``stop``): the answer text ends before the first one.

"First" is the one whose end comes first in the text (where two overlap, the one that
completes first, as a per-token check would find it).

Protocol-neutral, after the parser chain: only answer text is searched (reasoning
and calls pass through). Text that could be the start of a stop sequence is held
back until the next chunk decides, so the events are the same for any chunking;
the stop sequence itself is never shown, and everything after it is dropped, as if
generation had stopped there. Held text keeps its output offsets (``TextSegment.start``)
so that logprobs still land on the tokens they belong to.
"""

from __future__ import annotations

from resq.postprocess.segments import Segment, TextSegment


class StopSequences:
    """Cuts the answer at the first of ``stops``; ``stopped`` once it did."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._held: list[TextSegment] = []
        self.stopped = False

    def feed(self, segments: list[Segment]) -> list[Segment]:
        """What of ``segments`` can be shown now."""
        out: list[Segment] = []
        for segment in segments:
            if self.stopped:
                break
            if isinstance(segment, TextSegment):
                out += self._text(segment)
            else:
                out += self._release(self._held_length())
                out.append(segment)
        return out

    def finish(self, segments: list[Segment]) -> list[Segment]:
        """The last ``segments``, then whatever was held back (generation ended)."""
        out = self.feed(segments)
        if not self.stopped:
            out += self._release(self._held_length())
        return out

    # --- internals -----------------------------------------------------------------------------

    def _held_length(self) -> int:
        return sum(len(piece.text) for piece in self._held)

    def _text(self, segment: TextSegment) -> list[Segment]:
        if not segment.text:
            return []
        self._held.append(segment)
        text = "".join(piece.text for piece in self._held)
        # The stop sequence that ends first wins (as an engine checking after every token would
        # see it), then the one that starts first: the same cut whatever the chunking.
        found = [(at + len(stop), at) for stop in self._stops if (at := text.find(stop)) >= 0]
        if found:
            self.stopped = True
            shown = self._release(min(found)[1])
            self._held = []
            return shown
        return self._release(len(text) - self._undecided_tail(text))

    def _undecided_tail(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins some stop sequence."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _release(self, count: int) -> list[Segment]:
        """The first ``count`` held characters as segments (pieces split where needed)."""
        out: list[Segment] = []
        while count > 0 and self._held:
            piece = self._held[0]
            if len(piece.text) <= count:
                out.append(piece)
                self._held.pop(0)
                count -= len(piece.text)
                continue
            out.append(TextSegment(piece.text[:count], piece.logprobs, piece.start))
            self._held[0] = TextSegment(piece.text[count:], piece.logprobs, piece.start + count)
            count = 0
        return out
