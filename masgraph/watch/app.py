"""`masgraph watch`: a Textual app over a run directory, live or finished (views: graph, episodes, training).

The app polls the run directory (RunIndex) a few times a second; it never talks to the run itself, so it watches
a run in another process, over SSH, or one that ended long ago, all the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.style import Style
from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical, VerticalScroll
from textual.geometry import Size
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import Footer, Input, Sparkline, Static, TabbedContent, TabPane

from masgraph.errors import MasgraphError
from masgraph.watch import render
from masgraph.watch import table as episode_table
from masgraph.watch.index import Row, RunIndex

READ_BUDGET = 16 << 20
"""Bytes of the run's files read per poll: a large run is caught up with over several polls, the app answering
keys between them."""

KEYS = """\
[b]Everywhere[/b]
  1 2 3 / g e t   graph · episodes · training view
  ?               this help          q   quit
[b]Episodes[/b]
  ↑ ↓ PgUp PgDn Home End   move      Enter / click   open the episode
  /   search (id, item, query, answer; Enter applies, Esc clears)
  f   filter: all → failed → correct → wrong
  v   training runs: all → rollouts → evaluation (held-out episodes)
  n   only episodes where a node failed: next node
  s   sort: finished → reward → tokens → turns → time      r   reverse
[b]Episode[/b]
  p   unfold the prompts      l   colour output tokens by log-prob      Esc   back
"""


class EpisodeTable(ScrollView, can_focus=True):
    """A table of finished episodes that draws only the rows on screen (the line API), so 100k rows stay fast."""

    BINDINGS = [Binding("up", "move(-1)", show=False), Binding("down", "move(1)", show=False),
                Binding("pageup", "page(-1)", show=False), Binding("pagedown", "page(1)", show=False),
                Binding("home", "jump(0)", show=False), Binding("end", "jump(-1)", show=False),
                Binding("enter", "open", "open", show=False)]
    DEFAULT_CSS = "EpisodeTable { height: 1fr; }"

    class Open(Message):
        def __init__(self, row: Row) -> None:
            super().__init__()
            self.row = row

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rows: list[Row] = []
        self.cursor = 0

    def set_rows(self, rows: list[Row]) -> None:
        self.rows = rows
        self.cursor = min(self.cursor, max(0, len(rows) - 1))
        self.virtual_size = Size(self.size.width, len(rows) + 1)  # + the header line
        self.refresh()

    def render_line(self, y: int) -> Strip:
        """Line 0 is the column header (it stays put); line y > 0 is row scroll_y + y - 1."""
        width = self.scrollable_content_region.width
        if y == 0:
            return self._strip(episode_table.header_text(width), width)
        i = self.scroll_offset.y + y - 1
        if i >= len(self.rows):
            return Strip.blank(width)
        text = episode_table.row_text(self.rows[i], width)
        if i == self.cursor:
            text.stylize(Style(reverse=True, bold=self.has_focus))
        return self._strip(text, width)

    def _strip(self, text: Text, width: int) -> Strip:
        return Strip(list(text.render(self.app.console)), text.cell_len).adjust_cell_length(width)

    def action_move(self, delta: int) -> None:
        self._go(self.cursor + delta)

    def action_page(self, direction: int) -> None:
        self._go(self.cursor + direction * max(1, self.size.height - 2))

    def action_jump(self, where: int) -> None:
        self._go(where if where >= 0 else len(self.rows) - 1)

    def action_open(self) -> None:
        if self.rows:
            self.post_message(self.Open(self.rows[self.cursor]))

    def on_click(self, event: Any) -> None:
        i = self.scroll_offset.y + event.y - 1
        if 0 <= i < len(self.rows):
            if i == self.cursor:
                self.action_open()
            self._go(i)

    def _go(self, i: int) -> None:
        if not self.rows:
            return
        self.cursor = max(0, min(i, len(self.rows) - 1))
        top, height = self.scroll_offset.y, self.size.height - 1
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False)
        elif self.cursor >= top + height:
            self.scroll_to(y=self.cursor - height + 1, animate=False)
        self.refresh()


class MetricPanel(Vertical):
    """One training metric: its name, last value and range, and a sparkline of its steps."""

    DEFAULT_CSS = """
    MetricPanel { height: 5; border: round $primary-darken-2; padding: 0 1; }
    MetricPanel > Static { height: 1; }
    MetricPanel > Sparkline { height: 2; }
    """

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def compose(self) -> ComposeResult:
        yield Static(self.key, classes="label")
        yield Sparkline([])

    def show(self, points: list[tuple[int, float]]) -> None:
        values = [v for _, v in points]
        label = Text(self.key, style="bold")
        if values:
            label.append(f" {values[-1]:.3g}", style="cyan")
            label.append(f"  {min(values):.3g}…{max(values):.3g}", style="dim")
        self.query_one(Static).update(label)
        self.query_one(Sparkline).data = values


class EpisodeScreen(Screen):
    """One episode's step timeline."""

    BINDINGS = [Binding("escape", "app.pop_screen", "back"), Binding("p", "toggle('prompts')", "prompts"),
                Binding("l", "toggle('colours')", "log-prob colours")]

    def __init__(self, index: RunIndex, row: Row) -> None:
        super().__init__()
        self.index, self.row = index, row
        self.trace = index.trace(row)
        self.credit = index.credits.get(row.id)
        self.counterfactual = index.counterfactuals.get(row.id)
        self.show = {"prompts": False, "colours": False}
        self.decode: Any = None
        self.tokenizer_note = "loading the tokenizer…"
        """Why prompts are not shown as text yet: the tokenizer is loading, or (once it is known) not available."""

    def compose(self) -> ComposeResult:
        yield Static(render.episode_header(self.row, self.trace), id="episode-header")
        with VerticalScroll(id="timeline"):
            if self.trace is None:
                yield Static(Text("the episode's lines are not readable in events.jsonl (cut or removed)",
                                  style="bold red"))
            else:
                for step in self.trace.steps:
                    yield Static(render.step_text(step, credit=self.credit, counterfactual=self.counterfactual),
                                 classes="step")
        yield Static(Text(self.tokenizer_note, style="dim") if self._has_tokens() else "", id="episode-note")
        yield Footer()

    def _has_tokens(self) -> bool:
        return self.trace is not None and any(c.prompt_ids for s in self.trace.steps for c in s.llm)

    def on_mount(self) -> None:
        if self._has_tokens():
            self.load_tokenizer()

    @work(thread=True, exclusive=True)
    def load_tokenizer(self) -> None:
        decode, note = tokenizer_for(self.index)
        self.app.call_from_thread(self._tokenizer_ready, decode, note)

    def _tokenizer_ready(self, decode: Any, note: str) -> None:
        self.decode, self.tokenizer_note = decode, note
        self.query_one("#episode-note", Static).update(Text(note, style="dim"))
        self._redraw()

    def action_toggle(self, what: str) -> None:
        self.show[what] = not self.show[what]
        self._redraw()

    def _redraw(self) -> None:
        if self.trace is None:
            return
        for widget, step in zip(self.query(".step"), self.trace.steps, strict=False):
            widget.update(render.step_text(step, self.decode, self.show["prompts"], self.show["colours"],  # type: ignore[attr-defined]
                                           self.credit, self.counterfactual, no_decode=self.tokenizer_note))


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "close")]
    DEFAULT_CSS = "HelpScreen { align: center middle; } HelpScreen > Static { width: 76; border: round $accent; }"

    def compose(self) -> ComposeResult:
        yield Static(KEYS + "\n  Esc or ? closes this help", markup=True)


class WatchApp(App):
    """Watch a run or training run directory, live or finished."""

    TITLE = "masgraph watch"
    CSS = """
    #status { height: 1; background: $boost; }
    #tabs { height: 1fr; }
    #warnings { height: auto; color: $warning; }
    #warnings.empty { display: none; }
    #table-bar { height: 1; color: $text-muted; }
    #search { dock: bottom; display: none; }
    #search.visible { display: block; }
    #metric-grid { grid-size: 3; grid-gutter: 0; height: auto; }
    #progress, #checkpoints { height: auto; }
    #episode-header { height: auto; max-height: 10; border-bottom: solid $primary-darken-2; }
    #episode-note { height: 1; }
    .step { margin-bottom: 1; }
    """
    BINDINGS = [Binding("q", "quit", "quit"), Binding("question_mark", "help", "help"),
                Binding("1,g", "tab('graph')", "graph"), Binding("2,e", "tab('episodes')", "episodes"),
                Binding("3,t", "tab('training')", "training"),
                Binding("slash", "search", "search", show=False), Binding("f", "filter", "filter", show=False),
                Binding("n", "node_filter", "node errors", show=False), Binding("s", "sort", "sort", show=False),
                Binding("v", "kind", "evaluation", show=False),
                Binding("r", "reverse", "reverse", show=False)]

    def __init__(self, run_dir: str | Path, poll_s: float = 0.25, index: RunIndex | None = None):
        super().__init__()
        self.index = index or RunIndex(run_dir)
        self.poll_s = poll_s
        self.outcome, self.node_error, self.search_text, self.sort, self.reverse = "all", None, "", "finished", False
        self.kind = "all"
        """Which episodes: all, training rollouts or held-out evaluations (table.KINDS)."""
        self.error: MasgraphError | None = None
        """Why the app stopped reading the run (a run file became unreadable); the app then exits with code 2."""
        self._shown = 0
        """Finished episodes already in the table (rows that came after are appended or re-selected)."""
        self._first = 0
        """`seq` of the index's first kept row when the table was filled (older rows dropped since: re-select)."""
        self._panels: dict[str, MetricPanel] = {}

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield Static(id="warnings")
        with TabbedContent(initial="episodes" if not self.index.is_training else "training", id="tabs"):
            with TabPane("Graph [1]", id="graph"), VerticalScroll():
                yield Static(id="graph-view")
            with TabPane("Episodes [2]", id="episodes"):
                yield Static(id="table-bar")
                yield EpisodeTable(id="table")
                yield Input(placeholder="search id, item, query or answer; Enter applies, Esc clears", id="search")
            with TabPane("Training [3]", id="training"), VerticalScroll():
                yield Static(id="progress")
                yield Grid(id="metric-grid")
                yield Static(id="node-table")
                yield Static(id="checkpoints")
        yield Footer()

    def on_mount(self) -> None:
        self._poll()
        self.refresh_views(full=True)
        self.set_interval(self.poll_s, self.tick)

    def tick(self) -> None:
        if self._poll():
            self.refresh_views()

    def _poll(self) -> bool:
        """Read on in the run (READ_BUDGET bytes at most); a run file that cannot be read ends the app (code 2)."""
        if self.error is not None:
            return False
        try:
            return self.index.poll(READ_BUDGET)
        except MasgraphError as exc:
            self.error = exc
            self.exit(return_code=2)
            return False

    # -- drawing ---------------------------------------------------------------------------------------------

    def refresh_views(self, full: bool = False) -> None:
        self.query_one("#status", Static).update(render.status_line(self.index))
        warnings = self.index.warnings
        box = self.query_one("#warnings", Static)
        box.update(Text("⚠ " + "; ".join(warnings)) if warnings else "")
        box.set_class(not warnings, "empty")
        self.query_one("#graph-view", Static).update(render.graph_text(self.index))
        self._refresh_table(full)
        self._refresh_training()

    def _refresh_table(self, full: bool = False) -> None:
        table = self.query_one(EpisodeTable)
        rows, done = self.index.rows, self.index.n_done
        first = rows[0].seq if rows else 0
        plain = self.outcome == "all" and self.kind == "all" and not self.node_error and not self.search_text
        if not full and plain and self.sort == "finished" and not self.reverse and first == self._first:
            if done > self._shown:  # live, in finishing order: append the new rows only
                table.set_rows(table.rows + rows[self._shown - first:])
        else:
            table.set_rows(episode_table.select(rows, self.outcome, self.node_error, self.search_text, self.sort,
                                         self.reverse, self.kind))
        self._shown, self._first = done, first
        bar = Text()
        bar.append(f"{len(table.rows):,}/{len(rows):,} episodes", style="bold")
        if done > len(rows):
            bar.append(f" (the last {len(rows):,} of {done:,})", style="dim")
        bar.append(f" · filter {self.outcome}" + (f" · {self.node_error} failed" if self.node_error else ""))
        if self.kind != "all":
            bar.append(f" · {self.kind} only", style="cyan")
        bar.append(f" · sort {self.sort}{' ↓' if self.reverse else ''}")
        if self.search_text:
            bar.append(f" · search “{self.search_text}”", style="cyan")
        bar.append("  (? keys)", style="dim")
        self.query_one("#table-bar", Static).update(bar)

    def _refresh_training(self) -> None:
        metrics = self.index.metrics
        self.query_one("#progress", Static).update(
            render.progress(self.index) if metrics or self.index.is_training else Text(
                "not a training run: no metrics.jsonl", style="dim"))
        grid = self.query_one("#metric-grid", Grid)
        for key in render.plot_keys(metrics):
            if key not in self._panels:
                self._panels[key] = MetricPanel(key)
                grid.mount(self._panels[key])
        for key, panel in self._panels.items():
            if panel.is_mounted:
                panel.show(render.series(metrics, key))
            else:
                self.call_after_refresh(panel.show, render.series(metrics, key))
        self.query_one("#node-table", Static).update(render.node_table(self.index))
        self.query_one("#checkpoints", Static).update(render.checkpoints_text(self.index))

    # -- actions ---------------------------------------------------------------------------------------------

    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab
        if tab == "episodes":
            self.query_one(EpisodeTable).focus()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def _on_episodes(self) -> bool:
        return self.query_one(TabbedContent).active == "episodes"

    def action_search(self) -> None:
        if not self._on_episodes():
            self.action_tab("episodes")
        box = self.query_one("#search", Input)
        box.add_class("visible")
        box.value = self.search_text
        box.focus()

    @on(Input.Submitted, "#search")
    def _searched(self, event: Input.Submitted) -> None:
        self.search_text = event.value.strip()
        self._close_search()

    def on_key(self, event: Any) -> None:
        box = self.query_one("#search", Input)
        if event.key == "escape" and box.has_focus:
            self.search_text = ""
            self._close_search()
            event.stop()

    def _close_search(self) -> None:
        box = self.query_one("#search", Input)
        box.remove_class("visible")
        self.query_one(EpisodeTable).focus()
        self._refresh_table(full=True)

    def action_filter(self) -> None:
        self.outcome = episode_table.after(episode_table.FILTERS, self.outcome)
        self._refresh_table(full=True)

    def action_kind(self) -> None:
        self.kind = episode_table.after(episode_table.KINDS, self.kind)
        self._refresh_table(full=True)

    def action_node_filter(self) -> None:
        failing = [n for n, s in self.index.node_stats().items() if s.errors or s.parse_failures]
        order = [None, *failing]
        at = order.index(self.node_error) if self.node_error in order else 0
        self.node_error = order[(at + 1) % len(order)]
        self._refresh_table(full=True)

    def action_sort(self) -> None:
        self.sort = episode_table.after(episode_table.SORTS, self.sort)
        self.reverse = self.sort != "finished"  # biggest first for values, oldest first for finishing order
        self._refresh_table(full=True)

    def action_reverse(self) -> None:
        self.reverse = not self.reverse
        self._refresh_table(full=True)

    @on(EpisodeTable.Open)
    def _open(self, event: EpisodeTable.Open) -> None:
        self.push_screen(EpisodeScreen(self.index, event.row))

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        if event.pane.id == "episodes":
            self.query_one(EpisodeTable).focus()


def tokenizer_for(index: RunIndex) -> tuple[Any, str]:
    """A decode(ids) -> str for the run's first policy model, loaded from local files only; (None, why) when it
    cannot be had (the model is not installed here, or the spec names none)."""
    spec = index.spec
    models = [p.get("model") for p in (spec.policies.values() if spec else []) if isinstance(p, dict)]
    model = next((m for m in models if m), None)
    if model is None:
        return None, "no policy model in spec.yaml: prompts and tokens cannot be shown as text"
    try:
        from transformers import AutoTokenizer

        from masgraph.model import resolve_model

        tok = AutoTokenizer.from_pretrained(resolve_model(model), local_files_only=True)
    except Exception as exc:  # a missing model or tokenizer must not take the view down
        return None, f"tokenizer of {model} not available here ({type(exc).__name__}): showing token counts"
    return (lambda ids: tok.decode(ids)), f"tokens decoded with {model}'s tokenizer"
