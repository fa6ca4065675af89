// What a draft model samples from, as src/spececd/core/sampling.py computes it for the
// drafter (process_logits, SparseProbs.from_dense, draft_distribution): temperature, top-k
// and top-p on the logits, in float64, and in exact mode a cut to the `maxSupport` most
// likely tokens, renormalised, which is then both what the page samples from and what it
// reports. The verifier stays lossless for whatever distribution it is sent, as long as the
// drafted token was drawn from it.
//
// Draws use the page's own generator, seeded by (seed, position): a run is reproducible in
// the page, but its exact-mode draws are not the Python edge's (their distribution is).

/** A generator of uniform numbers in [0, 1) for one position of one session (mulberry32
 * over a mix of the seed and the position). */
export function positionRng(seed, position) {
  let state = (Math.imul(seed >>> 0, 0x9e3779b1) ^ Math.imul(position + 1, 0x85ebca6b)) >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** The index of the largest value (the first of equals, as numpy's argmax). */
export function argmax(values) {
  let best = 0;
  for (let i = 1; i < values.length; i++) if (values[i] > values[best]) best = i;
  return best;
}

/** Logits [vocab] to float64 probabilities per temperature (> 0), topK and topP. */
export function processLogits(logits, { temperature, topK, topP }) {
  const vocab = logits.length;
  const scores = new Float64Array(vocab);
  for (let i = 0; i < vocab; i++) scores[i] = logits[i] / temperature;
  if (topK > 0 && topK < vocab) {
    const kth = Float64Array.from(scores).sort()[vocab - topK];
    for (let i = 0; i < vocab; i++) if (scores[i] < kth) scores[i] = -Infinity;
  }
  if (topP < 1) {
    // Ascending by score (stable), cumulative softmax; drop the tokens whose cumulative mass
    // stays within 1 - topP, always keeping the most likely.
    const order = Array.from(scores.keys()).sort((a, b) => scores[a] - scores[b] || a - b);
    const sorted = softmax(Float64Array.from(order, (i) => scores[i]));
    let cumulative = 0;
    for (let j = 0; j < vocab - 1; j++) {
      cumulative += sorted[j];
      if (cumulative <= 1 - topP) scores[order[j]] = -Infinity;
    }
  }
  return softmax(scores);
}

function softmax(scores) {
  let max = -Infinity;
  for (const s of scores) if (s > max) max = s;
  const out = new Float64Array(scores.length);
  let sum = 0;
  for (let i = 0; i < scores.length; i++) {
    out[i] = Math.exp(scores[i] - max);
    sum += out[i];
  }
  for (let i = 0; i < out.length; i++) out[i] /= sum;
  return out;
}

/** The non-zero part of `probs`, cut to its `maxSupport` most likely tokens (0: all),
 * renormalised, ids ascending: {ids, probs (Float32Array, summing to 1)}. */
export function sparse(probs, maxSupport) {
  let ids = [];
  for (let i = 0; i < probs.length; i++) if (probs[i] > 0) ids.push(i);
  if (maxSupport > 0 && ids.length > maxSupport) {
    ids = ids.sort((a, b) => probs[b] - probs[a] || a - b).slice(0, maxSupport)
      .sort((a, b) => a - b);
  }
  let sum = 0;
  for (const i of ids) sum += probs[i];
  return { ids, probs: Float32Array.from(ids, (i) => probs[i] / sum) };
}

/** Draw an index from `probs` (non-negative, positive sum) by inverse CDF with `rng`. */
export function sample(probs, rng) {
  let total = 0;
  for (const p of probs) total += p;
  const u = rng() * total;
  let cumulative = 0;
  let last = 0;
  for (let i = 0; i < probs.length; i++) {
    if (probs[i] <= 0) continue;
    cumulative += probs[i];
    last = i;
    if (u < cumulative) return i;
  }
  return last;
}
