// The page's block drafted ahead (web/src/edge.js's Ahead): used only where the verdict kept
// every drafted token and its own was the guess, cut to the room left, with its
// distributions and counts aligned to its tokens; drafted with the same source contract as
// any round (a free block only where drafting costs nothing). Run: npm test (node --test).

import assert from "node:assert/strict";
import { test } from "node:test";

import { decode as unpack } from "@msgpack/msgpack";

import { Ahead, DraftLength, generate } from "../src/edge.js";
import { unpackIds } from "../src/protocol.js";

/** A source that drafts 100 + position for each position after `history`, one-hot
 * distributions, and counts its calls; `free` drafts only where `freeBlocks`. */
function source({ freeBlocks = true, lookedUp = 0 } = {}) {
  const calls = [];
  const block = (history, k) => {
    const tokens = Array.from({ length: k }, (_, i) => 100 + history.length + i);
    return { tokens, dists: tokens.map((t) => ({ ids: [t], probs: [1] })), lookedUp,
      predicted: lookedUp };
  };
  return {
    calls,
    async draft(history, k) { calls.push(["draft", history.length, k]); return block(history, k); },
    async free(history, k) { calls.push(["free", history.length, k]); return freeBlocks ? block(history, k) : null; },
  };
}

const settings = { mode: "exact", params: { temperature: 1 }, maxSupport: 8 };

test("a block drafted ahead continues a history that kept the block and took the guess", async () => {
  const drafts = source();
  const context = [1, 2, 3, 4]; // the history (1, 2) and the block sent (3, 4)
  const ahead = new Ahead(drafts, context, 3, false, settings);
  assert.deepEqual(drafts.calls, [["draft", 4, 4]]); // the guess and 3 more
  const guess = 104;
  const block = await ahead.block([...context, guess], 8);
  assert.deepEqual(block.tokens, [105, 106, 107]);
  assert.deepEqual(block.dists.map((d) => d.ids[0]), block.tokens); // aligned with its tokens
  assert.deepEqual(await ahead.block([...context, guess], 2).then((b) => b.tokens), [105, 106]);
});

test("a verdict that rejected a drafted token or took another token finds no block", async () => {
  const ahead = new Ahead(source(), [1, 2, 3, 4], 3, false, settings);
  assert.equal(await ahead.block([1, 2, 3, 9], 8), null); // rejected the block's 4
  assert.equal(await ahead.block([1, 2, 3, 4, 99], 8), null); // the target's token, not the guess
  assert.equal(await ahead.block([1, 2, 3, 4, 104, 105], 8), null); // another length
  assert.equal(await ahead.block([7, 2, 3, 4, 104], 8), null); // another history
});

test("a free round's block ahead is drafted only for free, and a block of the guess alone is none", async () => {
  const none = source({ freeBlocks: false });
  const ahead = new Ahead(none, [1, 2], 3, true, settings);
  assert.deepEqual(none.calls, [["free", 2, 4]]);
  assert.equal(await ahead.block([1, 2, 102], 8), null);
  const short = new Ahead(source(), [1, 2], 0, false, settings);
  assert.equal(await short.block([1, 2, 102], 8), null); // the guess alone: drafted anew
});

test("looked-up and predicted counts are the block's own (the guess taken off)", async () => {
  const ahead = new Ahead(source({ lookedUp: 3 }), [1, 2], 4, true, settings);
  const block = await ahead.block([1, 2, 102], 8);
  assert.equal(block.tokens.length, 4);
  assert.equal(block.lookedUp, 2);
  assert.equal(block.predicted, 2);
});

test("a failed draft ahead fails the round that uses it, and nobody else", async () => {
  const failing = { async draft() { throw new Error("worker gone"); }, async free() { return null; } };
  const ahead = new Ahead(failing, [1, 2], 3, false, settings);
  await assert.rejects(ahead.block([1, 2, 102], 8), /worker gone/);
});

test("a model draft that costs more than it brings is not drafted, but measured again now and then", () => {
  const length = new DraftLength(8);
  length.allowNone = true;
  // Rounds of 20 ms, a draft step of 200 ms, half the drafts kept.
  for (let i = 0; i < 4; i++) length.observe(2, 1, 0.4, 0.02);
  const chosen = [];
  for (let i = 0; i < 10; i++) {
    const k = length.choose(100);
    chosen.push(k);
    length.observe(k, 0, k ? 0.2 * k : null, 0.02);
  }
  assert.deepEqual(chosen.slice(0, 8), Array(8).fill(0));
  assert.ok(chosen[8] > 0); // after EXPLORE rounds without drafts
  // Where a step is cheap, it drafts.
  const cheap = new DraftLength(8);
  cheap.allowNone = true;
  for (let i = 0; i < 4; i++) cheap.observe(4, 3, 0.004, 0.02);
  assert.ok(cheap.choose(100) > 1);
  // Free drafts' policy (allowNone off) never chooses none.
  const free = new DraftLength(8);
  for (let i = 0; i < 4; i++) free.observe(2, 0, 0.4, 0.02);
  assert.ok(free.choose(100) >= 1);
});

test("no draft is never chosen because the round-time line reaches zero at k = 0", () => {
  // 90% kept, 2 ms steps, rounds of 10 ms at k = 1 and 100 ms at k = 8: the fitted line
  // crosses 0 below k = 1, where a round without drafts still costs a round trip.
  const length = new DraftLength(8);
  length.allowNone = true;
  for (let i = 0; i < 6; i++) {
    const k = i % 2 ? 8 : 1;
    length.observe(k, k === 8 ? 7 : 1, 0.002 * k, k === 8 ? 0.1 : 0.01);
  }
  assert.ok(length.choose(100) > 0);
});

/** A source like the hybrid: its free drafts (a lookup's, up to 4 tokens) follow `target`
 * after the prompt where `matches`, its model's never do; the model is `behind` tokens
 * behind (far: rounds go without it while it catches up, CATCH_UP). It records the warms
 * asked of it and its stops. */
function hybrid(promptLen, target, matches, behind = 100) {
  const self = {
    warms: [],
    stops: 0,
    behind: () => behind,
    async draft(history, k) { return { tokens: Array(k).fill(7), dists: null, lookedUp: 0 }; },
    async free(history, k) {
      const at = history.length - promptLen;
      const tokens = matches ? target.slice(at, at + Math.min(k, 4)) : [];
      return tokens.length ? { tokens, dists: null, lookedUp: tokens.length } : null;
    },
    warm(history) { self.warms.push(history.length); },
    stop() { self.stops += 1; },
  };
  return self;
}

/** A verifier that plays `target` after `prompt`: each round keeps the drafted tokens that
 * follow it and adds its next one. */
function verifier(prompt, target) {
  let at = 0; // tokens of target emitted
  return {
    async exchange(session, make) {
      if (make === null) return { maxContext: 4096, maxDraft: 64, width: 32 };
      const tokens = unpackIds(unpack(make())[4]); // [DRAFT, seq, at, prefix, tokens, ...]
      let n = 0;
      while (n < tokens.length && tokens[n] === target[at + n]) n += 1;
      const verdict = { numAccepted: n, nextToken: target[at + n], verified: tokens.length,
        verifyS: 0 };
      at += n + 1;
      return verdict;
    },
  };
}

test("the model reads along only in rounds that drafted nothing, not in a lookup's", async () => {
  const prompt = [1, 2, 3];
  const target = Array.from({ length: 40 }, (_, i) => 10 + i);
  const options = { params: { maxTokens: 30, temperature: 0, topK: 0, topP: 1, seed: 0,
    stopIds: [] }, mode: "match", k: "auto", maxSupport: 8, ahead: false };
  for (const matches of [true, false]) {
    const source = hybrid(prompt.length, target, matches);
    const out = await generate(verifier(prompt, target), prompt,
      { ...options, fingerprint: {}, source });
    assert.deepEqual(out.tokens, target.slice(0, 30));
    if (matches) assert.deepEqual(source.warms, []); // every round a lookup's: never read
    else assert.ok(source.warms.length > 0); // rounds without drafts: it catches up
  }
});

test("a run stops at its next exchange once its signal is aborted (Stop)", async () => {
  const prompt = [1, 2, 3];
  const target = Array.from({ length: 40 }, (_, i) => 10 + i);
  // Lookup rounds; model rounds with blocks drafted ahead; the server generating.
  for (const [cloudOnly, matches, ahead] of [[false, true, false], [false, false, true],
    [true, false, false]]) {
    const source = cloudOnly ? null : hybrid(prompt.length, target, matches, 0);
    const played = verifier(prompt, target);
    const link = cloudOnly ? { // the server generates: a token a frame
      at: 0,
      async exchange(session, make) {
        if (make === null) return { maxContext: 4096, maxDraft: 64, width: 32 };
        make(true);
        return { tokenIds: [target[this.at++]], done: false, computeS: 0 };
      },
      drop() {},
    } : played;
    const controller = new AbortController();
    let pieces = 0;
    const options = { params: { maxTokens: 30, temperature: 0, topK: 0, topP: 1, seed: 0,
      stopIds: [] }, mode: "match", k: "auto", maxSupport: 8, ahead,
    fingerprint: {}, source, signal: controller.signal };
    await assert.rejects(generate(link, prompt, options, () => {
      if (++pieces === 2) controller.abort();
    }), { name: "AbortError" });
    assert.equal(pieces, 2); // nothing exchanged after the abort
    if (source) assert.equal(source.stops, 1); // the drafter's work for the run stopped
  }
});
