// The target's tokenizer, as the server hands it to edges: GET /v1/tokenizer on the
// server's WebSocket port (plain HTTP) is a msgpack bundle of the fingerprint the handshake
// compares, the end-of-sequence ids and the tokenizer's files
// (src/spececd/backends/bundle.py). The page tokenizes with its tokenizer.json through
// @huggingface/tokenizers, in JavaScript; tests/web/test_browser_edge.py checks its ids
// against the Python tokenizer's on the held-out prompts.

import { Tokenizer } from "@huggingface/tokenizers";
import { decode as unpack } from "@msgpack/msgpack";

// The most token ids a healing mask may name (src/spececd/healing.py's MAX_HEAL_IDS).
export const MAX_HEAL_IDS = 8192;

export class TargetTokenizer {
  /** The tokenizer of the server whose plain-HTTP address is `httpBase`. */
  static async fetch(httpBase) {
    const reply = await fetch(`${httpBase}/v1/tokenizer`);
    if (!reply.ok) {
      throw new Error(`the server could not share its tokenizer (HTTP ${reply.status}: ` +
        `${(await reply.text()).trim()})`);
    }
    const bundle = unpack(new Uint8Array(await reply.arrayBuffer()));
    const files = bundle.files;
    if (!files["tokenizer.json"]) {
      throw new Error("the target's tokenizer has no tokenizer.json, which the page needs");
    }
    const text = (name) => new TextDecoder().decode(files[name]);
    const config = files["tokenizer_config.json"] ? JSON.parse(text("tokenizer_config.json")) : {};
    return new TargetTokenizer(new Tokenizer(JSON.parse(text("tokenizer.json")), config), {
      vocab_size: bundle.vocab_size, tokenizer_hash: bundle.tokenizer_hash,
    }, bundle.eos_token_ids);
  }

  constructor(tokenizer, fingerprint, eosIds) {
    this.tokenizer = tokenizer;
    this.fingerprint = fingerprint;
    this.eosIds = Array.from(eosIds);
  }

  /** The ids of `text`, with the tokenizer's own special tokens (as the Python edge's
   * encode with bos), or without them (`special` false: text inside a sequence, such as a
   * prediction of the output). */
  encode(text, special = true) {
    return this.tokenizer.encode(text, { add_special_tokens: special }).ids;
  }

  /** Each token id's text as it reads inside a text (decoded after an anchor token),
   * computed once (src/spececd/healing.py's token_texts). */
  tokenTexts() {
    if (!this.texts) {
      const anchor = this.encode("a").slice(0, 1);
      const before = this.decode(anchor).length;
      this.texts = Array.from({ length: this.fingerprint.vocab_size },
        (_, token) => this.decode([...anchor, token]).slice(before));
    }
    return this.texts;
  }

  /** Token healing, as src/spececd/healing.py's heal: the prompt without its last token,
   * the ids the first generated token may take (those whose text starts with the dropped
   * token's) and the dropped text; null where healing is left out. */
  heal(ids) {
    const last = ids[ids.length - 1];
    if (ids.length < 2 || this.eosIds.includes(last) || !(last >= 0 && last < this.fingerprint.vocab_size)) {
      return null;
    }
    const texts = this.tokenTexts();
    const dropped = texts[last];
    if (!dropped || dropped.includes("\ufffd")) return null;
    const allowed = [];
    texts.forEach((text, token) => {
      if (text.startsWith(dropped) && !this.eosIds.includes(token)) allowed.push(token);
    });
    if ((allowed.length === 1 && allowed[0] === last) || allowed.length > MAX_HEAL_IDS) return null;
    return { promptIds: ids.slice(0, -1), allowed, dropped };
  }

  decode(ids) {
    return this.tokenizer.decode(ids, { skip_special_tokens: false,
      clean_up_tokenization_spaces: false });
  }
}
