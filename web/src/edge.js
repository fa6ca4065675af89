// The page's generation loop (src/spececd/edge/client.py's plain rounds and cloud-only
// generation): greet the verifier, then draft up to k tokens, send them, take the accepted
// drafts and the verifier's own token, until a stop token, max_tokens or the context limit.
// The page holds the authoritative history; stop tokens and max_tokens are applied here,
// exactly (src/spececd/core/stopping.py's clip_emitted).

import { EdgeSession } from "./protocol.js";

// The most tokens a model draft waits for its model to feed first (what its cache lacks of
// the history, and what the calls in flight feed), with k auto. Further behind (a prompt's
// prefill, a long run of looked-up tokens), a round goes without the model's drafts while
// the model catches up in its worker: a prefill in WebAssembly takes longer than many
// rounds. (A fixed k drafts every round, waiting where it must.)
export const CATCH_UP = 8;

/** The tokens to emit (at most `remaining`, up to and including the first stop token) and
 * whether the generation is finished. */
export function clipEmitted(tokens, stopIds, remaining) {
  const out = [];
  for (const token of tokens) {
    if (out.length === remaining) return [out, true];
    out.push(token);
    if (stopIds.includes(token)) return [out, true];
  }
  return [out, out.length === remaining];
}

const EXPLORE = 8; // rounds without drafts before one drafts again, to measure anew

/**
 * The draft length for each round, chosen from what this generation measured (Leviathan
 * et al. 2023's expected tokens per round over the round's time, as the Python edge's
 * DraftLengthPolicy chooses): each drafted position is kept with probability `alpha`
 * (estimated from where rounds stopped), a round of k drafts gains (1 - alpha^(k+1)) /
 * (1 - alpha) tokens and costs k draft steps and one round trip, which grows with the
 * positions the server verifies (a least-squares line through the rounds' times against
 * their drafts' lengths, as the Python policy's verify fit). Until a few rounds are
 * measured it drafts `initial` (default `kMax`). Drafts that cost nothing (a lookup, a
 * prediction) have one of their own, up to the server's pass width, from 8.
 */
export class DraftLength {
  constructor(kMax, initial = kMax) {
    this.kMax = kMax;
    this.initial = Math.min(initial, kMax);
    this.kept = 0; // drafted positions accepted
    this.stops = 0; // rounds that stopped at a rejected draft
    this.rounds = 0;
    this.stepSeconds = 0; // a draft step, moving average
    this.stepped = false; // whether a draft step was measured
    // A round's time besides drafting against its draft's length: moving averages of k,
    // seconds, k² and k x seconds (the newest weighing 0.2).
    this.fit = { x: 0, y: 0, xx: 0, xy: 0 };
    this.allowNone = false; // whether a round may draft nothing (model drafts, k auto)
    this.idle = 0; // rounds in a row that chose to draft nothing
    this.fastest = Infinity; // the fastest round measured, seconds besides drafting
  }

  /** Seconds a round of `k` drafts takes besides drafting: base + slope x k, each at least
   * 0; the mean where every round drafted as many. */
  roundSeconds(k) {
    const { x, y, xx, xy } = this.fit;
    const variance = xx - x * x;
    const slope = variance > 1e-9 * Math.max(1, xx) ? Math.max(0, (xy - x * y) / variance) : 0;
    return Math.max(0, y - slope * x) + slope * k;
  }

  choose(limit) {
    const most = Math.min(this.kMax, limit);
    if (this.rounds < 3 || most <= 1) return Math.min(this.initial, most);
    const alpha = Math.min(0.99, (this.kept + 1) / (this.kept + this.stops + 2));
    // No draft at all where a draft step costs more than it brings (the verifier's token
    // alone), but a draft again after EXPLORE such rounds, to measure anew.
    // (a round without drafts costs at least the fastest round measured: the fit's line may
    // reach 0 at k = 0)
    const none = this.allowNone && this.idle < EXPLORE;
    let best = 1, bestRate = none ? 1 / Math.max(this.roundSeconds(0), this.fastest) : 0;
    if (none) best = 0;
    for (let k = 1; k <= most; k++) {
      const rate = (1 - alpha ** (k + 1)) / (1 - alpha)
        / (k * this.stepSeconds + this.roundSeconds(k));
      if (rate > bestRate) [best, bestRate] = [k, rate];
    }
    return best;
  }

  /** A round drafted `k` tokens in `draftSeconds` (null: looked up, no draft step), of
   * which `accepted` were kept, and took `roundSeconds` besides. */
  observe(k, accepted, draftSeconds, roundSeconds) {
    const ema = (old, x) => (this.rounds ? 0.8 * old + 0.2 * x : x);
    const fit = this.fit;
    [fit.x, fit.y, fit.xx, fit.xy] = [ema(fit.x, k), ema(fit.y, roundSeconds),
      ema(fit.xx, k * k), ema(fit.xy, k * roundSeconds)];
    if (k > 0 && draftSeconds !== null) {
      this.stepSeconds = this.stepped ? 0.8 * this.stepSeconds + 0.2 * draftSeconds / k
        : draftSeconds / k;
      this.stepped = true;
    }
    this.kept += accepted;
    if (accepted < k) this.stops += 1;
    this.idle = k === 0 ? this.idle + 1 : 0;
    this.fastest = Math.min(this.fastest, roundSeconds);
    this.rounds += 1;
  }
}

/**
 * A block drafted ahead while a verdict travels (src/spececd/edge/strategies.py's Ahead):
 * the guess of the verifier's own token followed by the next round's draft, drafted after
 * `context` (the history and the block sent). Drafting is a function of the history and the
 * position only, so it is exactly the block the next round would draft: lossless by
 * construction. `free`: the block sent cost nothing to draft, and so must this one (a
 * lookup's, a prediction's), else it is none.
 */
export class Ahead {
  constructor(source, context, k, free, settings) {
    this.source = source;
    this.context = context;
    this.k = k;
    this.free = free;
    this.drafted = free ? source.free(context, 1 + k, settings)
      : source.draft(context, 1 + k, settings);
    this.drafted.catch(() => {}); // a failure is the next round's (or nobody's, if none)
  }

  /** The next round's draft (at most `limit` tokens) where the verdict kept every drafted
   * token and its own was the guess, else null (also where the block ends at its guess:
   * the round drafts anew). */
  async block(history, limit) {
    const context = this.context;
    if (history.length !== context.length + 1 || context.some((token, i) => history[i] !== token)) {
      // The verdict rejected a drafted token: the block is not waited for, and its drafting
      // stops where it can.
      if (this.source.cancel) this.source.cancel();
      return null;
    }
    // The verdict kept the block: its drafting stops after the guess unless that is right.
    if (this.source.expect) this.source.expect(history[context.length]);
    const drafted = await this.drafted;
    if (!drafted || drafted.tokens.length < 2 || history[context.length] !== drafted.tokens[0]) {
      return null;
    }
    const n = Math.min(this.k, limit);
    const cut = (count) => Math.max(0, Math.min((count || 0) - 1, n));
    return { tokens: drafted.tokens.slice(1, 1 + n),
      dists: drafted.dists && drafted.dists.slice(1, 1 + n), lookedUp: cut(drafted.lookedUp),
      predicted: cut(drafted.predicted) };
  }
}

/** Statistics of one generation, as the Python edge counts them. */
export class Stats {
  constructor() {
    this.generated = 0;
    this.rounds = 0;
    this.drafted = 0;
    this.accepted = 0;
    this.lookedUpAccepted = 0;
    this.predictedAccepted = 0; // drafts from a prediction of the output, accepted
    this.aheadRounds = 0; // rounds that drafted the next block while their verdict travelled
    this.aheadHits = 0; // rounds that sent a block drafted ahead
    this.draftSeconds = 0;
    this.verifySeconds = 0;
    this.wallSeconds = 0;
  }

  get acceptance() {
    return this.drafted ? this.accepted / this.drafted : 0;
  }

  /** (accepted + rounds) / rounds: tokens gained per target pass. */
  get meanAcceptedLength() {
    return this.rounds ? (this.accepted + this.rounds) / this.rounds : 0;
  }

  get tokensPerSecond() {
    return this.wallSeconds ? this.generated / this.wallSeconds : 0;
  }
}

/**
 * Generate after `promptIds` against the verifier `link` reaches.
 * `options`: {fingerprint, authToken, params: {maxTokens, temperature, topK, topP, seed,
 * stopIds}, mode ("exact" or "match"), k (a number, or "auto"), maxSupport, source (null:
 * cloud-only), healIds
 * (token healing's mask for the first position, or null), signal (an AbortSignal, or none:
 * aborted, the run throws its reason, an AbortError, before its next exchange)};
 * `onPiece({tokens, fromDraft, lookedUp, predicted})` gets what each exchange emitted (of
 * its first `fromDraft` tokens, drafted and accepted, the first `lookedUp` looked up and the
 * first `predicted` from a prediction of the output).
 */
export async function generate(link, promptIds, options, onPiece = () => {}) {
  const { params, source, signal } = options;
  const cloudOnly = source === null;
  const stats = new Stats();
  const started = performance.now();
  const session = new EdgeSession({ fingerprint: options.fingerprint,
    mode: cloudOnly ? "match" : options.mode, temperature: params.temperature,
    topK: params.topK, topP: params.topP, seed: params.seed, authToken: options.authToken,
    healIds: options.healIds || null, promptLen: promptIds.length });
  const welcome = await link.exchange(session, null);
  const history = Array.from(promptIds);
  const maxContext = welcome.maxContext;
  const settings = { mode: options.mode, params, maxSupport: options.maxSupport,
    promptLen: promptIds.length };
  // A number: that many drafts a round (at most); "auto": chosen each round, up to 8, and
  // drafts that cost nothing up to the server's pass width.
  const auto = options.k === "auto";
  const length = new DraftLength(Math.min(auto ? 8 : options.k, welcome.maxDraft));
  length.allowNone = auto;
  const freeLength = new DraftLength(Math.max(length.kMax, welcome.width), length.kMax);
  // Whether drafts report the distributions they were drawn from (exact mode, sampling); a
  // fixed k then drafts whole blocks whatever the budget (a seed fixes the tokens only so),
  // as the Python edge does.
  const reports = options.mode === "exact" && params.temperature > 0;
  const blocks = !auto && reports;
  // The draft length under `policy` with `limit` positions left, after `context`: never past
  // the server's budget (it would cut the rest), except in whole blocks (the Python edge's
  // Rounds.choose); with k auto, none with the model where it is more than CATCH_UP tokens
  // behind the context (the round goes without it while it catches up).
  const choose = (policy, limit, context = history) => {
    const room = blocks || session.budget === null ? limit : Math.min(limit, session.budget);
    if (!auto) return Math.min(length.kMax, room);
    if (policy === length && source.behind && source.behind(context) > CATCH_UP) return 0;
    return policy.choose(room);
  };
  let finished = false;

  const emit = (tokens, fromDraft, lookedUp, predicted, drafted, done) => {
    const [out, clipped] = clipEmitted(tokens, params.stopIds, params.maxTokens - stats.generated);
    const kept = Math.min(fromDraft, out.length);
    history.push(...tokens);
    stats.generated += out.length;
    if (drafted !== null) {
      // Where the text ended inside this round, only its drafted positions up to the end
      // count (src/spececd/edge/emit.py).
      stats.rounds += 1;
      stats.drafted += out.length < tokens.length ? Math.min(drafted, out.length) : drafted;
      stats.accepted += kept;
    }
    stats.lookedUpAccepted += Math.min(lookedUp, kept);
    stats.predictedAccepted += Math.min(predicted, kept);
    finished = clipped || done || history.length >= maxContext;
    onPiece({ tokens: out, fromDraft: kept, lookedUp: Math.min(lookedUp, kept),
      predicted: Math.min(predicted, kept) });
  };

  // A block drafted while the last verdict travelled (options.ahead), or null.
  let ahead = null;
  try {
    if (cloudOnly) {
      let requested = false, done = false;
      while (!finished) {
        if (signal) signal.throwIfAborted();
        const reply = await link.exchange(session, (greetedNow) => {
          if (requested && !greetedNow) return null; // the stream is under way: only read
          requested = true;
          return session.generate(history, Math.min(params.maxTokens - stats.generated,
            maxContext - history.length), params.stopIds);
        });
        stats.verifySeconds += reply.computeS;
        done = reply.done;
        emit(reply.tokenIds, 0, 0, 0, null, done);
      }
      // Ended here (a stop token) while the server generates: its next frames belong to no
      // generation, so this connection ends.
      if (!done) link.drop();
    } else {
      while (!finished) {
        if (signal) signal.throwIfAborted();
        // The verifier adds one token of its own.
        const limit = Math.max(0, Math.min(params.maxTokens - stats.generated,
          maxContext - history.length) - 1);
        const t0 = performance.now();
        // A draft that costs nothing (a lookup's match, a prediction) has its own length
        // policy (with k auto), and goes before a block the model drafted ahead: it may run
        // far, where the model's is a few tokens.
        const freeBlock = () => (auto ? source.free(history, choose(freeLength, limit), settings)
          : null);
        const modelAhead = ahead !== null && !ahead.free;
        let block = modelAhead ? await freeBlock() : null;
        if (block && source.cancel) source.cancel();
        let free = block !== null;
        if (!block && ahead) {
          block = await ahead.block(history, limit);
          free = block ? ahead.free : false;
          if (block) stats.aheadHits += 1;
        }
        if (!block && !modelAhead) {
          block = await freeBlock();
          free = block !== null;
        }
        ahead = null;
        if (!block) {
          const k = choose(length, limit);
          block = k > 0 ? await source.draft(history, k, settings)
            : { tokens: [], dists: reports ? [] : null, lookedUp: 0 };
        }
        const policy = free ? freeLength : length;
        const t1 = performance.now();
        const pending = link.exchange(session,
          () => session.draft(history, block.tokens, block.dists));
        // The next block, drafted while this verdict travels, as if it keeps every drafted
        // token and its own is the draft's next: used only where that is so.
        const next = Math.min(params.maxTokens - stats.generated,
          maxContext - history.length) - block.tokens.length - 2;
        const context = [...history, ...block.tokens];
        const aheadK = options.ahead && next > 0 ? choose(policy, next, context) : 0;
        if (aheadK > 0) {
          ahead = new Ahead(source, context, aheadK, free, settings);
          stats.aheadRounds += 1;
        }
        // A round that drafted nothing (the model catching up, nothing drafted ahead with
        // it) brings the model's cache up meanwhile. Rounds of free drafts leave it be: on
        // text that copies itself the lookup keeps matching, and the model's reading along
        // would take the device from the rest (the server, on one machine) for drafts
        // seldom asked for; at the next miss it catches up, while those rounds go empty as
        // lookup's would.
        if (!block.tokens.length && (!ahead || ahead.free) && source.warm) {
          source.warm(history);
        }
        const verdict = await pending;
        const roundSeconds = (performance.now() - t1) / 1000;
        const draftSeconds = (t1 - t0) / 1000;
        stats.draftSeconds += draftSeconds;
        stats.verifySeconds += verdict.verifyS;
        const n = verdict.numAccepted;
        // Where the server cut the draft (its budget), the positions past the cut were never
        // judged: neither rejections for the draft length nor drafted in the statistics.
        const judged = Math.min(block.tokens.length, verdict.verified ?? Infinity);
        // Looked-up tokens cost no draft step; a block drafted ahead cost only the wait for
        // it (what drafting adds to a round's time).
        policy.observe(judged, n, block.lookedUp === block.tokens.length ? null
          : draftSeconds, roundSeconds);
        emit([...block.tokens.slice(0, n), verdict.nextToken], n, Math.min(block.lookedUp, n),
          Math.min(block.predicted || 0, n), judged, false);
      }
    }
  } finally {
    // The drafter's work for this run (a block ahead, a warm) serves nobody now, whether the
    // run ended or failed: it stops, and the last block ahead is waited for (stopped, it
    // answers after its current step), so that the drafter is free for the next run.
    if (source && source.stop) source.stop();
    if (ahead) await ahead.drafted.catch(() => {});
    stats.wallSeconds = (performance.now() - started) / 1000;
  }
  return { tokens: history.slice(promptIds.length, promptIds.length + stats.generated), stats,
    welcome };
}
