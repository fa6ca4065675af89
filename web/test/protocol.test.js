// The page's codec against Python's: every frame of the golden corpus (encoded by
// spececd.protocol.messages; tests/web/golden_frames.py writes it) decodes to what Python
// reads in it, and no cut or corrupted frame makes the codec throw anything but a
// ProtocolError. Run: npm test (node --test), or through pytest (tests/web/test_golden_frames.py).

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { PROTOCOL_VERSION, ProtocolError, TICK, decodeFrame } from "../src/protocol.js";

const corpus = JSON.parse(readFileSync(new URL("./frames.json", import.meta.url), "utf8"));
const bytes = (hex) => Uint8Array.from(hex.match(/../g) || [], (b) => parseInt(b, 16));

test("the page speaks the protocol version and time unit Python encodes", () => {
  assert.equal(PROTOCOL_VERSION, corpus.protocol_version);
  assert.equal(TICK, corpus.tick);
});

for (const { name, frame, page } of corpus.frames) {
  test(`${name}: read as Python reads it`, () => {
    if ("error" in page) {
      assert.throws(() => decodeFrame(bytes(frame)), (exc) => {
        assert.ok(exc instanceof ProtocolError);
        assert.deepEqual({ error: exc.code, message: exc.message, fatal: exc.fatal, seq: exc.seq },
          page);
        return true;
      });
    } else {
      assert.deepEqual(decodeFrame(bytes(frame)), page);
    }
  });
}

test("a cut or corrupted frame is a ProtocolError, never another failure", () => {
  let seed = 7;
  const random = () => (seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31;
  for (const { frame } of corpus.frames) {
    const whole = bytes(frame);
    const variants = [];
    for (let cut = 0; cut < whole.length; cut++) variants.push(whole.slice(0, cut));
    for (let i = 0; i < 200; i++) {
      const bad = whole.slice();
      bad[Math.floor(random() * bad.length)] = Math.floor(random() * 256);
      variants.push(bad);
    }
    for (const variant of variants) {
      try {
        decodeFrame(variant);
      } catch (exc) {
        assert.ok(exc instanceof ProtocolError, `${exc} for ${Buffer.from(variant).toString("hex")}`);
        assert.ok(exc.code && exc.message);
      }
    }
  }
});
