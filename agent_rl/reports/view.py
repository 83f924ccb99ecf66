"""`agent-rl view`: a static HTML report of what the policy did, token by token.

Reads trajectory records (JSON lines from `agent-rl rollout --out`, `agent-rl eval
--trajectories`, or a training run's `OUTPUT_DIR/trajectories/step_N.jsonl`, written with
`run.save_trajectories_every`) and writes a report that opens from disk: no server, no
network, nothing loaded from outside the page.

- `index.html`: per step, the mean reward, EM and response length and the end reasons, with an
  inline SVG plot (a length blow-up shows at a glance); a table of every trajectory that
  filters by end reason, data source, step and reward range and sorts by length or reward. The
  rows are JSON in the page and a small script shows `PAGE_ROWS` at a time, so thousands of
  trajectories keep the page light; `index.html?reason=answer&sort=length:desc` opens filtered.
- `t/N.html`, one per trajectory: the prompt (collapsed), each turn's generated tokens shaded
  by loss mask (hover: token id, engine log-prob, trainer log-prob, advantage; a selector
  shades by those values instead), its query with the documents returned (title, score, text),
  retrieval latency and error, the inserted tokens and whether they were cut to fit; the end
  reason, reward, EM/F1 against the gold answers and the budget limits the trajectory hit.

Model output and documents are untrusted: every text goes through `html.escape`, JSON embedded
in a page has `<`, `>` and `&` escaped (it cannot close its `<script>` element), and each
page's Content-Security-Policy runs only the page's own script (by hash) and loads nothing.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from pathlib import Path

from agent_rl.rollout.protocol import extract_answer, policy_text
from agent_rl.rollout.rewards import answer_scores
from retriever_server.jsonl import iter_jsonl

PAGE_ROWS = 200  # rows of the index table shown at a time
BUDGET_END_REASONS = {
    "budget_total": "ended by the total token budget",
    "max_turns": "ended at budget.max_turns without an answer",
}


def read_records(inputs: list[Path]) -> list[dict]:
    """Trajectory records from JSONL files or folders of them (a run's `trajectories/`, read in
    step order). A missing input or a line that is not a trajectory record is an error naming
    the file (and line). Each record gets `_file` and `_line`; EM/F1 are computed when absent."""
    files: list[Path] = []
    for p in map(Path, inputs):
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"), key=lambda f: (len(f.stem), f.stem))  # step_2 before step_10
            if not found:
                raise FileNotFoundError(f"{p} holds no .jsonl files of trajectories")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(
                f"{p} does not exist: give JSONL files of trajectories (agent-rl rollout --out, agent-rl eval "
                "--trajectories) or a run's trajectories/ folder"
            )
    records = []
    for f in files:
        for n, rec in iter_jsonl(f):
            missing = [k for k in ("response_ids", "loss_mask") if not isinstance(rec.get(k), list)]
            if missing:
                raise ValueError(f"{f}:{n}: not a trajectory record (no {' or '.join(missing)} list)")
            if len(rec["loss_mask"]) != len(rec["response_ids"]):
                raise ValueError(
                    f"{f}:{n}: loss_mask has {len(rec['loss_mask'])} entries for {len(rec['response_ids'])} "
                    "response_ids"
                )
            if "em" not in rec and "response_text" in rec:
                rec.update(answer_scores(rec["response_text"], rec.get("golden_answers") or []))
            rec["_file"], rec["_line"] = str(f), n
            records.append(rec)
    return records


def turn_segments(rec: dict) -> list[tuple[dict, range, range]]:
    """(turn, generated positions, inserted positions) in response order. A turn's tokens are its
    `gen_tokens` sampled ones, then its `obs_tokens` inserted ones; when a record's counts do not
    add up to its response, each run of trained tokens with the masked run after it is a turn."""
    turns = rec.get("turns") or []
    n = len(rec["response_ids"])
    if sum(t.get("gen_tokens", 0) + t.get("obs_tokens", 0) for t in turns) == n:
        out, pos = [], 0
        for t in turns:
            gen, obs = t.get("gen_tokens", 0), t.get("obs_tokens", 0)
            out.append((t, range(pos, pos + gen), range(pos + gen, pos + gen + obs)))
            pos += gen + obs
        return out
    mask, out, pos = rec["loss_mask"], [], 0
    while pos < n:
        gen_end = pos
        while gen_end < n and mask[gen_end]:
            gen_end += 1
        obs_end = gen_end
        while obs_end < n and not mask[obs_end]:
            obs_end += 1
        t = turns[len(out)] if len(out) < len(turns) else {"action": "?"}
        out.append((t, range(pos, gen_end), range(gen_end, obs_end)))
        pos = obs_end
    return out


def budget_hits(rec: dict) -> list[str]:
    """The token-budget limits this trajectory ran into, in words."""
    hits = []
    for k, t in enumerate(rec.get("turns") or [], 1):
        if t.get("truncated"):
            hits.append(f"turn {k} stopped at budget.max_tokens_per_turn")
        if t.get("obs_truncated"):
            hits.append(f"turn {k}'s observation was cut to fit the budget")
    if rec.get("end_reason") in BUDGET_END_REASONS:
        hits.append(BUDGET_END_REASONS[rec["end_reason"]])
    return hits


def _esc(x) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _num(x, digits: int = 3) -> str:
    return "" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def script_json(obj) -> str:
    """JSON to embed in a page: `<`, `>` and `&` escaped, so no string in it can end the
    `<script>` element that holds it or open another (json.dumps already escapes U+2028/9)."""
    return json.dumps(obj).replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.2em 2em;color:#222;max-width:1200px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.4em}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 7px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.num{text-align:right;font-variant-numeric:tabular-nums}
.tok{white-space:pre-wrap;word-break:break-word;font-family:ui-monospace,Menlo,monospace;font-size:13px;line-height:1.7}
.tok span{border-radius:2px;box-shadow:inset -1px 0 0 #fff}.tok span:hover{outline:1px solid #333}
.m1{background:#cfe5ff}.m0{background:#ececec;color:#555}
.turn{border-left:4px solid #3b82c4;margin:1em 0;padding:.2em 0 .2em .8em}
.obs{border-left:4px solid #999;margin:.5em 0 .2em .4em;padding:.2em 0 .2em .7em;background:#fafafa}
.doc{margin:.3em 0}.doc-text{color:#444}.err{color:#b00020;font-weight:600}.warn{color:#a15c00}
.meta{display:grid;grid-template-columns:max-content auto;gap:2px 14px}.meta b{font-weight:600}
.legend span{padding:0 6px;margin-right:6px}
.plots{display:flex;gap:16px;flex-wrap:wrap;margin-bottom:10px}input[type=number]{width:6em}
"""


def _page(title: str, body: str, script: str = "", data: dict | None = None) -> str:
    """A whole page. Its CSP lets only `script` (pinned by its hash) run and loads nothing."""
    csp = "default-src 'none'; style-src 'unsafe-inline'"
    tail = ""
    if data is not None:
        tail += f"<script type='application/json' id='data'>{script_json(data)}</script>"
    if script:
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        csp += f"; script-src 'sha256-{digest}'"
        tail += f"<script>{script}</script>"
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta http-equiv='Content-Security-Policy' content=\"{csp}\">"
        f"<meta name='viewport' content='width=device-width'><title>{_esc(title)}</title>"
        f"<style>{STYLE}</style></head><body>{body}{tail}</body></html>"
    )


TRAJECTORY_SCRIPT = """
const D = JSON.parse(document.getElementById('data').textContent);
const spans = document.querySelectorAll('.tok span[data-i]');
function shade(mode) {
  for (const s of spans) {
    const i = +s.dataset.i, m = D.mask[i];
    let c = '';
    if (mode === 'engine' && m && D.engine) {
      const p = Math.exp(D.engine[i] || 0); c = `hsl(210,80%,${Math.round(95 - 45 * (1 - p))}%)`; }
    if (mode === 'diff' && m && D.trainer && D.engine && D.trainer[i] !== null) {
      const d = Math.min(1, Math.abs(D.trainer[i] - D.engine[i]) * 5); c = `hsl(0,85%,${Math.round(96 - 46 * d)}%)`; }
    if (mode === 'advantage' && m && D.advantage) {
      const a = Math.max(-1, Math.min(1, D.advantage[i]));
      c = a >= 0 ? `hsl(130,60%,${Math.round(96 - 40 * a)}%)` : `hsl(0,75%,${Math.round(96 + 40 * a)}%)`; }
    s.style.background = c;
  }
}
const sel = document.getElementById('shade');
sel.addEventListener('input', () => shade(sel.value));
"""


def _token_spans(rec: dict, positions: range) -> str:
    tokens, ids, mask = rec.get("tokens"), rec["response_ids"], rec["loss_mask"]
    series = [
        ("engine", rec.get("logprobs")),
        ("trainer", rec.get("trainer_logprobs")),
        ("advantage", rec.get("advantages")),
    ]
    out = []
    for i in positions:
        hover = [f"id {ids[i]}", "trained" if mask[i] else "inserted (mask 0)"]
        for label, values in series:
            if values is not None and i < len(values) and values[i] is not None:
                hover.append(f"{label} {values[i]:.4f}")
        text = tokens[i] if tokens is not None and i < len(tokens) else f"\u27e8{ids[i]}\u27e9"
        out.append(
            f"<span class='m{1 if mask[i] else 0}' data-i='{i}' title='{_esc(' | '.join(hover))}'>{_esc(text)}</span>"
        )
    return "".join(out)


def _docs_html(turn: dict) -> str:
    parts = []
    for k, d in enumerate(turn.get("docs") or [], 1):
        score = d.get("score")
        parts.append(
            f"<div class='doc'>{k}. <b class='doc-title'>{_esc(d.get('title'))}</b>"
            f"{'' if score is None else f' <span class=num>(score {float(score):.4f})</span>'}"
            f" <span class='doc-text'>{_esc(d.get('text'))}</span></div>"
        )
    return "".join(parts)


def trajectory_page(rec: dict, n: int, total: int) -> str:
    """The page of one trajectory (`t/n.html`)."""
    mask = rec["loss_mask"]
    trained = sum(1 for m in mask if m)
    answer = extract_answer(policy_text(rec.get("response_text", "")))
    hits = budget_hits(rec)
    facts = [
        ("end reason", f"<b id='end-reason'>{_esc(rec.get('end_reason'))}</b>"),
        ("reward", _esc(_num(rec.get("reward")))),
        ("EM / F1", f"{_esc(_num(rec.get('em')))} / {_esc(_num(rec.get('f1')))}"),
        ("answer", _esc(answer) if answer is not None else "<i>none</i>"),
        ("gold answers", _esc(", ".join(map(str, rec.get("golden_answers") or [])))),
        ("budget hits", _esc("; ".join(hits)) if hits else "none"),
        (
            "tokens",
            f"prompt {_esc(rec.get('prompt_tokens'))}, response {len(mask)}: "
            f"<span id='trained-count'>{trained}</span> trained, "
            f"<span id='masked-count'>{len(mask) - trained}</span> masked",
        ),
        ("data source", _esc(rec.get("data_source"))),
        ("prompt", f"{_esc(rec.get('prompt_id'))}, sample {_esc(rec.get('sample_idx'))}"),
        ("step", _esc(rec.get("step")) if rec.get("step") is not None else "-"),
        ("from", f"{_esc(rec['_file'])}, line {rec['_line']}"),
    ]
    if rec.get("excluded"):
        facts.append(
            (
                "excluded",
                "<span class='err'>a search failed: kept out of the loss (mask zeroed) and of its group's "
                "statistics</span>",
            )
        )
    if rec.get("trainer_logprobs") is None and rec.get("step") is not None:
        facts.append(("trainer log-probs", "not computed: the update skipped this row (advantage 0 on every token)"))
    nav = " ".join(
        x
        for x in (
            f"<a href='{n - 1}.html'>previous</a>" if n > 0 else "",
            "<a href='../index.html'>index</a>",
            f"<a href='{n + 1}.html'>next</a>" if n + 1 < total else "",
        )
        if x
    )
    body = [
        f"<p>{nav}</p><h1>Trajectory {n}: {_esc(rec.get('prompt_id'))} #{_esc(rec.get('sample_idx'))}</h1>",
        "<div class='meta'>" + "".join(f"<b>{k}</b><span>{v}</span>" for k, v in facts) + "</div>",
    ]
    if rec.get("prompt_text") is not None:
        body.append(
            f"<details><summary>prompt ({_esc(rec.get('prompt_tokens'))} tokens)</summary><div class='tok "
            f"obs'>{_esc(rec['prompt_text'])}</div></details>"
        )
    body.append(
        "<p class='legend'>shade tokens by <select id='shade'><option value='mask'>loss mask</option>"
        "<option value='engine'>engine probability (darker: less likely)</option><option value='diff'>|trainer - "
        "engine| log-prob (darker: larger)</option>"
        "<option value='advantage'>advantage (green +, red -)</option></select> "
        "<span class='m1'>trained (mask 1)</span><span class='m0'>inserted (mask 0)</span> hover a token for its id "
        "and values</p>"
    )
    for k, (turn, gen, obs) in enumerate(turn_segments(rec), 1):
        flags = " <span class='warn'>(stopped at budget.max_tokens_per_turn)</span>" if turn.get("truncated") else ""
        body.append(
            f"<div class='turn'><div>turn {k}: <b>{_esc(turn.get('action'))}</b>, {len(gen)} generated "
            f"tokens{flags}</div>"
            f"<div class='tok'>{_token_spans(rec, gen)}</div>"
        )
        if turn.get("call_error"):  # rollout.protocol=tool_calls: why the call could not run
            body.append(f"<div class='err'>tool call refused: {_esc(turn['call_error'])}</div>")
        if turn.get("query") is not None or turn.get("retriever_error") or turn.get("docs"):
            body.append(
                f"<div class='obs'><div>query: <b class='query'>{_esc(turn.get('query'))}</b> &middot; "
                f"retrieval {float(turn.get('retrieval_ms') or 0.0):.1f} ms</div>"
            )
            if turn.get("retriever_error"):
                tool = _esc(turn.get("action") or "tool")
                body.append(f"<div class='err'>{tool} error: {_esc(turn['retriever_error'])}</div>")
            body.append(_docs_html(turn) or "<div><i>no documents</i></div>")
            body.append("</div>")
        if len(obs):
            cut = " <span class='warn'>(cut to fit the budget)</span>" if turn.get("obs_truncated") else ""
            body.append(
                f"<details class='obs'><summary>inserted after the turn: {len(obs)} tokens{cut}</summary>"
                f"<div class='tok'>{_token_spans(rec, obs)}</div></details>"
            )
        body.append("</div>")
    data = {
        "mask": mask,
        "engine": rec.get("logprobs"),
        "trainer": rec.get("trainer_logprobs"),
        "advantage": rec.get("advantages"),
    }
    return _page(f"trajectory {n}", "".join(body), TRAJECTORY_SCRIPT, data)


def step_summaries(rows: list[dict]) -> list[dict]:
    """Per step (None for records without one): count, mean reward, EM and response length, the
    longest response, and how many trajectories ended for each reason."""
    by_step: dict = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    out = []
    for step in sorted(by_step, key=lambda s: (s is None, s if s is not None else 0)):
        rs = by_step[step]
        reasons: dict[str, int] = {}
        for r in rs:
            reasons[str(r["end_reason"])] = reasons.get(str(r["end_reason"]), 0) + 1
        out.append(
            {
                "step": step,
                "n": len(rs),
                "reward": sum(r["reward"] for r in rs) / len(rs),
                "em": sum(r["em"] or 0.0 for r in rs) / len(rs),
                "length": sum(r["length"] for r in rs) / len(rs),
                "max_length": max(r["length"] for r in rs),
                "reasons": dict(sorted(reasons.items())),
            }
        )
    return out


def _plot(steps: list[dict], key: str, label: str, color: str) -> str:
    """A small inline SVG line of one per-step mean (two steps or more), its range on the y axis."""
    w, h, left, pad = 360, 150, 44, 18
    vals = [s[key] for s in steps]
    lo, hi = min(0.0, min(vals)), max(vals)
    hi = hi if hi > lo else lo + 1.0
    xs = [left + (w - left - pad) * i / (len(vals) - 1) for i in range(len(vals))]
    ys = [h - pad - (h - 2 * pad) * (v - lo) / (hi - lo) for v in vals]
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
    dots = "".join(
        f"<circle cx='{x:.1f}' cy='{y:.1f}' r='2.5' fill='{color}'><title>step {_esc(s['step'])}: "
        f"{v:.3f}</title></circle>"
        for x, y, s, v in zip(xs, ys, steps, vals)
    )
    first, last = steps[0]["step"], steps[-1]["step"]
    return (
        f"<svg width='{w}' height='{h}' role='img' aria-label='{_esc(label)} per step'><rect width='{w}' "
        f"height='{h}' fill='#fafafa' stroke='#ddd'/>"
        f"<text x='{left}' y='13' font-size='12' fill='{color}'>{_esc(label)}</text>"
        f"<text x='4' y='{pad + 4}' font-size='10'>{hi:.3g}</text><text x='4' y='{h - pad + 4}' "
        f"font-size='10'>{lo:.3g}</text>"
        f"<text x='{left}' y='{h - 4}' font-size='10'>step {_esc(first if first is not None else '-')}</text>"
        f"<text x='{w - pad}' y='{h - 4}' font-size='10' text-anchor='end'>"
        f"step {_esc(last if last is not None else '-')}</text>"
        f"<polyline fill='none' stroke='{color}' stroke-width='2' points='{pts}'/>{dots}</svg>"
    )


INDEX_SCRIPT = """
const D = JSON.parse(document.getElementById('data').textContent);
const ROWS = D.rows, PAGE = D.page_rows, COLS = D.columns, FLOATS = ['reward', 'em', 'f1'];
let page = 0;
const $ = id => document.getElementById(id);
function shown() {
  const reason = $('f-reason').value, source = $('f-source').value, step = $('f-step').value, sort = $('f-sort').value;
  const lo = parseFloat($('f-rmin').value), hi = parseFloat($('f-rmax').value);
  const rows = ROWS.filter(r => (!reason || String(r.end_reason) === reason)
    && (!source || String(r.data_source) === source)
    && (!step || String(r.step) === step) && !(r.reward < lo) && !(r.reward > hi));
  if (sort) {
    const [k, dir] = sort.split(':');
    rows.sort((a, b) => (dir === 'desc' ? b[k] - a[k] : a[k] - b[k]) || a.n - b.n);
  }
  return rows;
}
function render() {
  const rows = shown(), pages = Math.max(1, Math.ceil(rows.length / PAGE));
  page = Math.max(0, Math.min(page, pages - 1));
  const body = $('rows'); body.textContent = '';
  for (const r of rows.slice(page * PAGE, (page + 1) * PAGE)) {
    const tr = document.createElement('tr');
    for (const k of COLS) {
      const td = document.createElement('td'), v = r[k];
      if (k === 'n') {
        const a = document.createElement('a');
        a.href = 't/' + r.n + '.html'; a.textContent = String(r.n); td.appendChild(a);
      } else {
        td.textContent = v === null || v === undefined ? '' : (FLOATS.includes(k) ? Number(v).toFixed(3) : String(v));
      }
      if (typeof v === 'number') td.className = 'num';
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  $('count').textContent = rows.length + ' of ' + ROWS.length + ' trajectories; page ' + (page + 1) + ' of ' + pages;
}
// index.html?reason=answer&sort=length:desc opens with those filters set (a link to a view)
const FILTERS = {
  reason: 'f-reason', source: 'f-source', step: 'f-step', rmin: 'f-rmin', rmax: 'f-rmax', sort: 'f-sort',
};
const query = new URLSearchParams(location.search);
for (const [name, id] of Object.entries(FILTERS)) {
  if (query.has(name)) $(id).value = query.get(name);
  $(id).addEventListener('input', () => { page = 0; render(); });
}
$('prev').addEventListener('click', () => { page -= 1; render(); });
$('next').addEventListener('click', () => { page += 1; render(); });
render();
"""
COLUMNS = {
    "n": "#",
    "step": "step",
    "data_source": "data source",
    "prompt_id": "prompt",
    "sample_idx": "sample",
    "end_reason": "end reason",
    "reward": "reward",
    "em": "EM",
    "f1": "F1",
    "length": "response tokens",
    "trained": "trained tokens",
    "turns": "turns",
    "searches": "searches",
    "answer": "answer",
}


def _step_link(step) -> str:
    """A step's cell in the summary: a link that shows that step's trajectories in the table."""
    return "-" if step is None else f"<a href='?step={_esc(step)}#table'>{_esc(step)}</a>"


def _options(values) -> str:
    return "<option value=''>all</option>" + "".join(f"<option value='{_esc(v)}'>{_esc(v)}</option>" for v in values)


def index_page(rows: list[dict], inputs: list[Path]) -> str:
    steps = step_summaries(rows)
    summary = "".join(
        f"<tr><td>{_step_link(s['step'])}</td><td class=num>{s['n']}</td><td class=num>{s['reward']:.3f}</td>"
        f"<td class=num>{s['em']:.3f}</td><td class=num>{s['length']:.1f}</td><td class=num>{s['max_length']}</td>"
        f"<td>{_esc(', '.join(f'{k} {v}' for k, v in s['reasons'].items()))}</td></tr>"
        for s in steps
    )
    plots = (
        ""
        if len(steps) < 2
        else (
            "<div class='plots'>"
            + _plot(steps, "reward", "mean reward", "#1b7f3b")
            + _plot(steps, "length", "mean response tokens", "#c2410c")
            + "</div>"
        )
    )
    reasons = sorted({str(r["end_reason"]) for r in rows})
    sources = sorted({str(r["data_source"]) for r in rows})
    step_values = [s["step"] for s in steps if s["step"] is not None]
    body = (
        f"<h1>Trajectories: {len(rows)}</h1><p>from {_esc(', '.join(map(str, inputs)))}</p>"
        f"<h2>Per step</h2>{plots}<details{' open' if len(steps) <= 20 else ''}><summary>{len(steps)} step(s)</summary>"
        "<table><thead><tr><th>step</th><th>n</th><th>mean reward</th><th>mean EM</th>"
        "<th>mean response tokens</th><th>longest</th><th>end "
        f"reasons</th></tr></thead><tbody>{summary}</tbody></table></details>"
        "<h2 id='table'>Trajectories</h2><p>"
        f"end reason <select id='f-reason'>{_options(reasons)}</select> "
        f"data source <select id='f-source'>{_options(sources)}</select> "
        f"step <select id='f-step'>{_options(step_values)}</select> "
        "reward from <input id='f-rmin' type='number' step='0.1' value='' placeholder='min' size='5'> "
        "to <input id='f-rmax' type='number' step='0.1' value='' placeholder='max' size='5'> "
        "sort <select id='f-sort'><option value=''>as read</option><option value='reward:desc'>reward, high "
        "first</option>"
        "<option value='reward:asc'>reward, low first</option><option value='length:desc'>length, long first</option>"
        "<option value='length:asc'>length, short first</option></select></p>"
        "<p><button id='prev'>previous page</button> <span id='count'></span> <button id='next'>next page</button></p>"
        "<noscript><p>The table needs JavaScript; each trajectory's page is in t/N.html.</p></noscript>"
        "<table><thead><tr>"
        + "".join(f"<th>{_esc(v)}</th>" for v in COLUMNS.values())
        + "</tr></thead><tbody id='rows'></tbody></table>"
    )
    return _page(
        "agent-rl trajectories", body, INDEX_SCRIPT, {"rows": rows, "page_rows": PAGE_ROWS, "columns": list(COLUMNS)}
    )


def _row(n: int, rec: dict) -> dict:
    """What the index table shows (and filters and sorts by) for one trajectory."""
    turns = rec.get("turns") or []
    answer = extract_answer(policy_text(rec.get("response_text", "")))
    return {
        "n": n,
        "step": rec.get("step"),
        "data_source": rec.get("data_source"),
        "prompt_id": rec.get("prompt_id"),
        "sample_idx": rec.get("sample_idx"),
        "end_reason": rec.get("end_reason"),
        "reward": float(rec.get("reward") or 0.0),
        "em": rec.get("em"),
        "f1": rec.get("f1"),
        "length": len(rec["response_ids"]),
        "trained": sum(1 for m in rec["loss_mask"] if m),
        "turns": len(turns),
        "searches": sum(1 for t in turns if t.get("action") == "search"),
        "answer": None if answer is None else answer[:60],
    }


def write_report(inputs: list[Path], out_dir: Path) -> Path:
    """Write `out_dir/index.html` and `out_dir/t/N.html` per trajectory; returns the index's path.
    Pages a previous report left in `out_dir/t` are removed."""
    records = read_records(inputs)
    out_dir = Path(out_dir)
    pages = out_dir / "t"
    pages.mkdir(parents=True, exist_ok=True)
    for old in pages.glob("*.html"):
        old.unlink()
    rows = []
    for n, rec in enumerate(records):
        (pages / f"{n}.html").write_text(trajectory_page(rec, n, len(records)), encoding="utf-8")
        rows.append(_row(n, rec))
    index = out_dir / "index.html"
    index.write_text(index_page(rows, inputs), encoding="utf-8")
    return index
