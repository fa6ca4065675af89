// The playground's one view of a generation, whichever way it runs (the OpenAI API or the
// browser edge): a panel's statistics, its output with each token a span of its source's
// colour, and its details line.

export const $ = (id) => document.getElementById(id);

/** Where a shown token came from: its span's class (the legend's colours). */
export const SOURCES = new Set(["prediction", "forced", "lookup", "draft", "target", "fallback"]);

export const fixed = (x, digits) => (Number.isFinite(x) ? x.toFixed(digits) : "–");

/**
 * One panel of the page: `ids` names its elements (`output`, `details`, and the statistics
 * it has of `tps`, `acceptance`, `mal`, `tokens`, `prediction` with `predicted` and
 * `unpredicted`).
 */
export class Panel {
  constructor(ids) {
    this.ids = ids;
    this.output = $(ids.output);
    this.tps = null; // tokens a second of the last run, once it ended
  }

  reset() {
    for (const name of ["tps", "acceptance", "mal", "tokens", "predicted", "unpredicted"]) {
      if (this.ids[name]) $(this.ids[name]).textContent = "–";
    }
    if (this.ids.prediction) $(this.ids.prediction).hidden = true;
    $(this.ids.details).textContent = "";
    this.output.replaceChildren();
    this.tps = null;
  }

  /** Sets the statistics given (`acceptance` a fraction; `prediction` {accepted, rejected},
   * or null for a run without one), and the details line. */
  show({ tps, acceptance, mal, tokens, prediction, details }) {
    const set = (name, text) => { if (this.ids[name]) $(this.ids[name]).textContent = text; };
    if (tps !== undefined) set("tps", fixed(tps, 1));
    if (acceptance !== undefined) set("acceptance", fixed(100 * acceptance, 1));
    if (mal !== undefined) set("mal", fixed(mal, 2));
    if (tokens !== undefined) set("tokens", String(tokens));
    if (prediction !== undefined && this.ids.prediction) {
      $(this.ids.prediction).hidden = !prediction;
      if (prediction) {
        set("predicted", String(prediction.accepted));
        set("unpredicted", String(prediction.rejected));
      }
    }
    if (details !== undefined) $(this.ids.details).textContent = details;
  }

  /** Appends `text` to `into` (the output, or a turn of a conversation in it) in the colour
   * of `source`; `title` (optional) is shown on hover. */
  token(into, source, text, title = "") {
    const span = element("span", `tok ${SOURCES.has(source) ? source : "target"}`, text);
    if (title) span.title = title;
    into.append(span);
    this.output.scrollTop = this.output.scrollHeight;
  }
}

export function element(tag, className, text) {
  const el = document.createElement(tag);
  el.className = className;
  if (text) el.textContent = text;
  return el;
}
