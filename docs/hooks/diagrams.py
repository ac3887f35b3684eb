"""The docs' two diagrams as SVG files, drawn here (no Mermaid, no network): `python docs/hooks/diagrams.py` writes
docs/img/loop-tick.svg and docs/img/process-layout.svg; `tests/test_docs.py` checks the committed files are what
this draws. Plain SVG 1.1: boxes, arrows, text; the colours read on the light and the dark scheme."""

from __future__ import annotations

import sys
from html import escape
from pathlib import Path

FONT = "font-family='Roboto, Helvetica, Arial, sans-serif'"
INK, TRAIN, GEN, STORE = "#546e7a", "#e3f2fd", "#e8f5e9", "#fff8e1"


class Svg:
    def __init__(self, width: int, height: int):
        self.width, self.height, self.items = width, height, []

    def box(self, x, y, w, h, lines, fill, bold=False, rx=6, size=13):
        self.items.append(f"<rect x='{x}' y='{y}' width='{w}' height='{h}' rx='{rx}' fill='{fill}' "
                          f"stroke='{INK}' stroke-width='1.2'/>")
        top = y + h / 2 - (len(lines) - 1) * (size + 3) / 2 + size / 3
        for i, line in enumerate(lines):
            self.text(x + w / 2, top + i * (size + 3), line, size=size, bold=bold and i == 0)

    def frame(self, x, y, w, h, title):
        self.items.append(f"<rect x='{x}' y='{y}' width='{w}' height='{h}' rx='8' fill='none' stroke='{INK}' "
                          "stroke-dasharray='5 4' stroke-width='1'/>")
        self.text(x + 10, y + 16, title, size=12, anchor="start", bold=True)

    def text(self, x, y, s, size=13, anchor="middle", bold=False, italic=False):
        style = (" font-weight='bold'" if bold else "") + (" font-style='italic'" if italic else "")
        self.items.append(f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}' fill='#263238' "
                          f"{FONT}{style}>{escape(s)}</text>")

    def arrow(self, x1, y1, x2, y2, label="", dashed=False, label_dy=-6, size=12, both=False):
        dash = " stroke-dasharray='6 4'" if dashed else ""
        start = " marker-start='url(#tail)'" if both else ""
        self.items.append(f"<line x1='{x1}' y1='{y1}' x2='{x2}' y2='{y2}' stroke='{INK}' stroke-width='1.5'"
                          f"{dash}{start} marker-end='url(#head)'/>")
        if label:
            self.text((x1 + x2) / 2, (y1 + y2) / 2 + label_dy, label, size=size)

    def render(self) -> str:
        defs = ("<defs><marker id='head' markerWidth='10' markerHeight='8' refX='9' refY='4' orient='auto'>"
                f"<path d='M0,0 L10,4 L0,8 z' fill='{INK}'/></marker>"
                "<marker id='tail' markerWidth='10' markerHeight='8' refX='1' refY='4' orient='auto'>"
                f"<path d='M10,0 L0,4 L10,8 z' fill='{INK}'/></marker></defs>")
        body = "\n".join(self.items)
        return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{self.width}' height='{self.height}' "
                f"viewBox='0 0 {self.width} {self.height}'>\n<rect width='100%' height='100%' fill='white'/>\n"
                f"{defs}\n{body}\n</svg>\n")


def loop_tick() -> str:
    """One tick of the loop: weights to the generator, rollouts to the trainer, then both sides work at once."""
    s = Svg(900, 380)
    tx, gx = 220, 680
    s.box(tx - 130, 12, 260, 40, ["trainer ranks (FSDP2)"], TRAIN, bold=True)
    s.box(gx - 130, 12, 260, 40, ["generator ranks (vLLM)"], GEN, bold=True)
    for x in (tx, gx):
        s.items.append(f"<line x1='{x}' y1='52' x2='{x}' y2='360' stroke='{INK}' stroke-dasharray='3 3'/>")
    s.box(tx - 60, 66, gx - tx + 120, 26, ["tick t"], "#eceff1", size=12)
    s.arrow(tx, 120, gx, 120, "policy_weights: the newest version's weights (nccl_ddma: each rank its own shard)")
    s.arrow(gx, 165, tx, 165, "rollouts: the groups of batch t - max_staleness, each to its trainer rank")
    s.frame(40, 190, 820, 120, "both sides at once")
    s.box(tx - 175, 220, 350, 72, ["score, compute advantages,", "train batch t - max_staleness",
                                   "(one optimizer step per pass)"], TRAIN, size=12)
    s.box(gx - 175, 220, 350, 72, ["sample batch t (tool calls included)", "under the weights just received"],
          GEN, size=12)
    s.box(tx - 60, 325, gx - tx + 120, 26, ["tick t + 1: the version just trained goes to the generator"],
          "#eceff1", size=12)
    return s.render()


def process_layout() -> str:
    """Ranks, worlds and the channels between them."""
    s = Svg(1000, 470)
    s.frame(20, 20, 250, 250, "trainer world (ranks 0 .. T-1)")
    s.box(40, 50, 210, 54, ["trainer rank 0", "FSDP2 shard, hosts the store"], TRAIN, bold=True, size=12)
    s.box(40, 160, 210, 54, ["trainer rank 1", "FSDP2 shard"], TRAIN, bold=True, size=12)
    s.frame(560, 20, 420, 200, "generator replica 0 (its own world)")
    s.box(580, 50, 380, 66, ["generator rank T", "vLLM, tensor-parallel rank 0",
                             "runs tools and environments"], GEN, bold=True, size=12)
    s.box(580, 140, 380, 54, ["generator rank T+1", "vLLM, tensor-parallel rank 1"], GEN, bold=True, size=12)
    s.frame(560, 250, 420, 150, "generator replica 1 (its own world)")
    s.box(580, 280, 380, 40, ["generator rank T+2"], GEN, bold=True, size=12)
    s.box(580, 340, 380, 40, ["generator rank T+3"], GEN, bold=True, size=12)
    s.box(60, 330, 170, 60, ["TCPStore", "heartbeats, rendezvous"], STORE, size=12, rx=20)
    s.arrow(145, 270, 145, 330, both=True)
    s.text(155, 305, "every rank", size=11, anchor="start", italic=True)
    s.arrow(250, 70, 580, 70, "bridge 0: weights (each rank its own shard)", size=11)
    s.arrow(250, 190, 580, 165, "", size=11)
    s.arrow(580, 100, 250, 90, "rollouts: each group to the trainer rank owning it", label_dy=18, size=11)
    s.arrow(250, 200, 580, 300, "bridge 1 (with fan_out 1: by relay)", dashed=True, label_dy=-10, size=11)
    s.arrow(940, 194, 940, 280)
    s.text(930, 240, "relay: each piece passed on as it arrives", size=11, anchor="end", italic=True)
    s.arrow(580, 360, 250, 210, "rollouts", label_dy=30, size=11)
    s.text(500, 440, "Weights flow from every trainer rank to the replicas; rollouts flow back to the trainer rank "
                     "that owns each group's position.", size=12)
    return s.render()


DIAGRAMS = {"loop-tick.svg": loop_tick, "process-layout.svg": process_layout}


def main(out: str) -> None:
    for name, draw in DIAGRAMS.items():
        (Path(out) / name).write_text(draw())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1] / "img"))
