// The page's link to `spececd serve`: one WebSocket at a time, greeted per session,
// re-opened when it fails (src/spececd/edge/link.py's rules). When the socket drops, the link
// waits (exponential backoff with jitter), connects again, greets again and asks the caller
// for its frame anew: the session then re-sends the whole history as the draft's prefix, and
// since the verifier's randomness depends only on (seed, position) the reply is that of an
// uninterrupted run. Every other error the server answers is thrown at once, but `draining`,
// which sends the page to connect again at once.

import { ProtocolError } from "./protocol.js";

export class ConnectionLost extends Error {}

/** One WebSocket with a queue of received frames. */
class Socket {
  constructor(url) {
    this.url = url;
    this.frames = [];
    this.waiting = null;
    this.failure = null;
    this.bytesSent = 0;
    this.bytesReceived = 0;
    this.ws = new WebSocket(url);
    this.ws.binaryType = "arraybuffer";
    this.opened = new Promise((resolve, reject) => {
      this.ws.onopen = () => resolve();
      this.ws.onerror = () => reject(new ConnectionLost(`cannot connect to ${url}`));
    });
    this.ws.onmessage = (event) => {
      const data = event.data instanceof ArrayBuffer ? event.data
        : new TextEncoder().encode(event.data).buffer;
      this.bytesReceived += data.byteLength;
      this.frames.push(data);
      this.wake();
    };
    this.ws.onclose = (event) => {
      this.failure = new ConnectionLost(
        `connection to ${url} closed (${event.code}${event.reason ? ": " + event.reason : ""})`);
      this.wake();
    };
  }

  wake() {
    const waiting = this.waiting;
    this.waiting = null;
    if (waiting) waiting();
  }

  send(frame) {
    if (this.ws.readyState !== WebSocket.OPEN) {
      throw this.failure || new ConnectionLost(`connection to ${this.url} is not open`);
    }
    this.ws.send(frame);
    this.bytesSent += frame.byteLength;
  }

  /** The next frame, within `timeoutMs` (else the link is deemed dead: ConnectionLost); a
   * frame that arrived before the socket closed is still read. */
  async recv(timeoutMs) {
    const deadline = performance.now() + timeoutMs;
    for (;;) {
      if (this.frames.length) return this.frames.shift();
      if (this.failure) throw this.failure;
      const left = deadline - performance.now();
      if (left <= 0) {
        throw new ConnectionLost(`no reply from ${this.url} within ${timeoutMs / 1000} s`);
      }
      let timer;
      await new Promise((resolve) => {
        this.waiting = resolve;
        timer = setTimeout(resolve, left);
      });
      clearTimeout(timer);
    }
  }

  close() {
    this.ws.onclose = null;
    try { this.ws.close(); } catch { /* closing a broken socket */ }
  }
}

// Seconds without a reply before the link is deemed dead (the Python edge's --round-timeout).
export const ROUND_TIMEOUT_MS = 120000;

export class Link {
  /** `url`: the server's ws:// or wss:// address; `reconnect`: attempts and first delay;
   * `timeoutMs`: how long a reply may take. */
  constructor(url, { attempts = 8, delayMs = 100, maxDelayMs = 2000,
    timeoutMs = ROUND_TIMEOUT_MS } = {}) {
    this.url = url;
    this.timeoutMs = timeoutMs;
    this.attempts = attempts;
    this.delayMs = delayMs;
    this.maxDelayMs = maxDelayMs;
    this.socket = null;
    this.greeted = null; // the session this socket greeted
    this.reconnects = 0;
    this.refused = null; // the lowest hello version the server refused, if any
  }

  async open() {
    const socket = new Socket(this.url);
    await socket.opened;
    return socket;
  }

  /** Close the socket without a word; the next exchange connects and greets again. */
  drop() {
    if (this.socket) this.socket.close();
    this.socket = null;
    this.greeted = null;
  }

  close(session) {
    if (this.socket && session) {
      try { this.socket.send(session.close()); } catch { /* already gone */ }
    }
    this.drop();
  }

  /** Greet with `session` if this socket has not, send `makeFrame()` (null: read only, a
   * stream is under way) and return the reply (the welcome when makeFrame is null);
   * reconnect and retry when the socket fails. */
  async exchange(session, makeFrame) {
    let failures = 0;
    for (;;) {
      try {
        if (!this.socket) this.socket = await this.open();
        const socket = this.socket;
        const greetedNow = this.greeted !== session;
        if (greetedNow) {
          if (this.refused !== null) session.olderServer(this.refused);
          const version = session.versions[0];
          socket.send(session.hello());
          let welcome;
          try {
            welcome = session.receive(await socket.recv(this.timeoutMs));
          } catch (exc) {
            // An older server: greet it again, on a new connection, at a version it speaks.
            if (!(exc instanceof ProtocolError && exc.code === "version_mismatch")
                || !session.olderServer()) throw exc;
            this.refused = version;
            this.drop();
            continue;
          }
          if (welcome.type !== "welcome") throw new ProtocolError("unexpected_message", "no welcome");
          this.greeted = session;
        }
        if (makeFrame === null) return session.welcome;
        const frame = makeFrame(greetedNow);
        if (frame !== null) socket.send(frame);
        return session.receive(await socket.recv(this.timeoutMs));
      } catch (exc) {
        const draining = exc instanceof ProtocolError && exc.code === "draining";
        if (!(exc instanceof ConnectionLost) && !draining) throw exc;
        this.drop();
        failures += 1;
        if (failures > this.attempts) {
          throw new ConnectionLost(`cannot reach the verifier (${exc.message}) after ` +
            `${failures - 1} reconnection attempts; check that \`spececd serve\` runs at ${this.url}`);
        }
        this.reconnects += 1;
        const backoff = Math.min(this.delayMs * 2 ** (failures - 1), this.maxDelayMs);
        const wait = draining && failures === 1 ? 0 : backoff * (0.5 + Math.random() / 2);
        await new Promise((resolve) => setTimeout(resolve, wait));
      }
    }
  }
}
