// SpecECD's wire protocol in the browser: the frames (src/spececd/protocol/messages.py) and
// the edge's side of a session (src/spececd/protocol/edge_session.py), sans-I/O.
//
// A frame is one msgpack array [type, field, ...]. Token ids travel as a msgpack list or as
// raw little-endian uint16, whichever is shorter; a draft distribution as raw little-endian
// arrays (uint32 ids, float32 probabilities); the tokenizer hash as raw bytes. Fields a
// newer server adds after the ones read here are ignored (the protocol's optional trailing
// fields), so an older page keeps working against a newer server.

import { decode as unpack, encode as pack } from "@msgpack/msgpack";

// The version this page greets with (messages.py's WIDTH_VERSION): it reads the server's
// budget in verdicts (7) and its pass width in the welcome (8). An older server answers
// version_mismatch, and the page greets it again at 7, then at the lowest version that
// carries what it asks for (2, or 6 with token healing's mask), as the Python edge does.
export const PROTOCOL_VERSION = 8;
export const BUDGET_VERSION = 7;
export const HEALING_VERSION = 6;
export const TICK = 2.5e-4; // seconds per unit of time on the wire

const HELLO = 1, WELCOME = 2, DRAFT = 3, VERDICT = 4, CLOSE = 5, ERROR = 6, GENERATE = 7,
  TOKENS = 8;

/** A typed error the server answered (its stable `code`, and the `seq` of the step it
 * answers, -1 for the session's), or a malformed reply. */
export class ProtocolError extends Error {
  constructor(code, message, fatal = true, seq = -1) {
    super(message);
    this.code = code;
    this.fatal = fatal;
    this.seq = seq;
  }
}

/** Token ids as whichever is shorter: a msgpack list or raw little-endian uint16. */
export function packIds(ids) {
  let listed = 0;
  let small = ids.length > 1;
  for (const t of ids) {
    listed += t < 128 ? 1 : t < 65536 ? 3 : 5;
    if (t < 0 || t >= 65536) small = false;
  }
  if (small && 2 * ids.length + 2 < listed) {
    const bytes = new Uint8Array(2 * ids.length);
    const view = new DataView(bytes.buffer);
    ids.forEach((t, i) => view.setUint16(2 * i, t, true));
    return bytes;
  }
  return Array.from(ids);
}

export function unpackIds(value) {
  if (value instanceof Uint8Array) {
    if (value.length % 2) throw new ProtocolError("malformed_frame", "odd uint16 ids");
    const view = new DataView(value.buffer, value.byteOffset, value.byteLength);
    return Array.from({ length: value.length / 2 }, (_, i) => view.getUint16(2 * i, true));
  }
  if (!Array.isArray(value) || !value.every(isCount)) {
    throw new ProtocolError("malformed_frame", "token ids expected");
  }
  return value;
}

/** A whole number of at least 0 (msgpack's ints decode as numbers, or bigints past 2^53). */
function isCount(value) {
  return Number.isSafeInteger(value) && value >= 0;
}

/** The fields of a message of `type` after checking each against its kind (messages.py's
 * WIRE): a frame whose field is of another kind is malformed, as Python's decode says. */
function checked(type, body, kinds) {
  const ok = { count: isCount, int: Number.isSafeInteger,
    str: (v) => typeof v === "string", bool: (v) => typeof v === "boolean",
    "count?": (v) => v === null || v === undefined || isCount(v), any: () => true };
  kinds.forEach((kind, i) => {
    if (!ok[kind](body[i])) {
      throw new ProtocolError("malformed_frame", `message ${type}'s field ${i} is not a ${kind}`);
    }
  });
  return body;
}

/** Draft distributions ([{ids, probs}], one per drafted token) as the wire's three arrays. */
export function packProbs(dists) {
  const sizes = dists.map((d) => d.ids.length);
  const total = sizes.reduce((a, b) => a + b, 0);
  const ids = new Uint8Array(4 * total), probs = new Uint8Array(4 * total);
  const idView = new DataView(ids.buffer), probView = new DataView(probs.buffer);
  let j = 0;
  for (const d of dists) {
    for (let i = 0; i < d.ids.length; i++, j++) {
      idView.setUint32(4 * j, d.ids[i], true);
      probView.setFloat32(4 * j, d.probs[i], true);
    }
  }
  return [sizes, ids, probs];
}

function hexBytes(hex) {
  if (!/^([0-9a-f]{2})*$/i.test(hex)) return hex; // not hex: sent as a string
  return Uint8Array.from(hex.match(/../g) || [], (b) => parseInt(b, 16));
}

/** The frame of a Hello: [version, vocab, hash, mode, temperature, top_k, top_p, seed,
 * auth], and with token healing (`healIds`, the only tokens the first position after the
 * `promptLen` tokens of the prompt may take) [threshold 0, extras carrying the prompt's
 * length, no constraint, no log-probabilities, the mask]. */
export function helloFrame({ fingerprint, mode, temperature, topK, topP, seed, authToken,
  healIds = null, promptLen = 0 }, version = PROTOCOL_VERSION) {
  const healing = healIds !== null && healIds.length > 0;
  const body = [HELLO, version, fingerprint.vocab_size,
    hexBytes(fingerprint.tokenizer_hash), mode, temperature, topK, topP, seed,
    authToken || ""];
  if (healing) body.push(0, [1, 0, 0, 0, promptLen, [], []], null, null, packIds(healIds));
  return pack(body);
}

/** Decode one frame from the server into {type, ...fields}; unknown trailing fields are
 * left out, an Error frame becomes a thrown ProtocolError. */
export function decodeFrame(data) {
  let raw;
  try {
    raw = unpack(new Uint8Array(data));
  } catch (exc) {
    throw new ProtocolError("malformed_frame", `frame is not valid msgpack: ${exc}`);
  }
  if (!Array.isArray(raw) || !raw.length) {
    throw new ProtocolError("malformed_frame", "frame must be a msgpack array");
  }
  const [type, ...body] = raw;
  const need = (n) => {
    if (body.length < n) throw new ProtocolError("malformed_frame", `message ${type} is short`);
  };
  switch (type) {
    case WELCOME:
      need(4);
      checked(type, body, ["str", "count", "count", "count", "any", "any", "count?"]);
      // width: the longest draft the server verifies in one pass, within maxDraft (0: not
      // said, an older server: no long passes)
      return { type: "welcome", sessionId: body[0], protocolVersion: body[1],
        maxDraft: body[2], maxContext: body[3], lossy: Boolean(body[4]),
        width: Math.min(body[6] || 0, body[2]) };
    case VERDICT:
      need(4);
      checked(type, body, ["count", "count", "count", "count", "any", "any", "any", "count?",
        "count?"]);
      // budget: positions of the next draft the server expects to verify (null: any);
      // verified: the leading positions of this draft it verified when it cut the rest
      // (null: all)
      return { type: "verdict", seq: body[0], numAccepted: body[1], nextToken: body[2],
        verifyS: body[3] * TICK, budget: body[7] ?? null, verified: body[8] ?? null };
    case TOKENS:
      need(4);
      checked(type, body, ["count", "any", "bool", "count"]);
      return { type: "tokens", seq: body[0], tokenIds: unpackIds(body[1]), done: body[2],
        computeS: body[3] * TICK };
    case ERROR:
      need(4);
      checked(type, body, ["str", "str", "int", "bool"]);
      throw new ProtocolError(body[0], body[1], body[3], body[2]);
    default:
      throw new ProtocolError("unexpected_message", `unexpected message type ${type}`);
  }
}

/**
 * The drafter's side of one session: numbers drafts and tracks how much of the edge's
 * (authoritative) history the server holds, so that a draft carries only what it lacks and,
 * after a reconnect, the whole history again.
 */
export class EdgeSession {
  constructor(hello) {
    this.helloFields = hello; // see helloFrame
    const lowest = hello.healIds && hello.healIds.length ? HEALING_VERSION : 2;
    this.versions = [PROTOCOL_VERSION, BUDGET_VERSION, lowest]; // to offer, newest first
    this.welcome = null;
    this.serverLen = 0;
    this.seq = 0;
    this.pending = null;
    this.budget = null; // positions of the next draft the server expects to verify, as it said
  }

  /** The greeting; the server then holds nothing of this session. */
  hello() {
    this.welcome = null;
    this.serverLen = 0;
    this.pending = null;
    this.budget = null;
    return helloFrame(this.helloFields, this.versions[0]);
  }

  /** The server refused a hello of version `refused` (default: this session's own) with
   * version_mismatch: greet below it where a lower version carries what is asked; whether
   * one does. */
  olderServer(refused = this.versions[0]) {
    let stepped = false;
    while (this.versions.length > 1 && this.versions[0] >= refused) {
      this.versions.shift();
      stepped = true;
    }
    return stepped;
  }

  /** A draft of `tokens` (with `dists` in exact sampling mode, else null) after `history`. */
  draft(history, tokens, dists) {
    this.seq += 1;
    this.pending = { kind: "draft", seq: this.seq, contextLen: this.serverLen,
      prefixLen: history.length - this.serverLen, k: tokens.length };
    const body = [DRAFT, this.seq, this.serverLen, packIds(history.slice(this.serverLen)),
      packIds(tokens)];
    if (dists) body.push(packProbs(dists));
    return pack(body);
  }

  /** The frame asking the server to generate up to `maxTokens` itself (cloud-only). */
  generate(history, maxTokens, stopTokenIds) {
    this.seq += 1;
    this.pending = { kind: "generate", seq: this.seq };
    const frame = pack([GENERATE, this.seq, this.serverLen,
      packIds(history.slice(this.serverLen)), maxTokens, Array.from(stopTokenIds)]);
    this.serverLen = history.length;
    return frame;
  }

  /** The close frame (the session ends; the connection may carry another). */
  close(reason = "bye") {
    return pack([CLOSE, reason]);
  }

  /** A frame from the server: the welcome, or the verdict or tokens answering the request
   * pending, checked against it. Throws the ProtocolError an Error frame names. */
  receive(data) {
    const message = decodeFrame(data);
    if (message.type === "welcome" && this.welcome === null) {
      this.welcome = message;
      return message;
    }
    const pending = this.pending;
    if (message.type === "verdict" && pending?.kind === "draft" && message.seq === pending.seq) {
      if (!(message.numAccepted >= 0 && message.numAccepted <= pending.k)) {
        throw new ProtocolError("unexpected_message",
          `verdict accepts ${message.numAccepted} of ${pending.k} drafted tokens`);
      }
      this.serverLen = pending.contextLen + pending.prefixLen + message.numAccepted + 1;
      this.pending = null;
      this.budget = message.budget;
      return message;
    }
    if (message.type === "tokens" && pending?.kind === "generate" && message.seq === pending.seq) {
      this.serverLen += message.tokenIds.length;
      if (message.done) this.pending = null;
      return message;
    }
    throw new ProtocolError("unexpected_message", `unexpected ${message.type} from the server`);
  }
}
