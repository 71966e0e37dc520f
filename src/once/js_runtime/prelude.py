"""The JavaScript every program's isolate starts with: the bridge object and the globals.

`PRELUDE` evaluates to the installer, called once with the notification function, the
callable tool names and the run's options before the program starts. Everything the
program can reach is defined here:

- `tools.<name>(args)`: posts `["call", id, name, argsJson]` and returns a promise the host
  settles (`__once_host.settle` / `settleAll`); an unknown name still reaches the host,
  whose answer names the known tools;
- `print`, `text` and `console.*`: post `["print", text]`; the program's end posts
  `["done", ok, text]`;
- timers: live runs post `["timer", id, delay]` and the host fires them after that long;
  a replay keeps them on a virtual clock the host advances when the program is idle
  (`__once_host.advance`), so their order never depends on wall time;
- a replay also gets a seeded `Math.random` (mulberry32) and a `Date` frozen at the
  replay's epoch (moved only by the virtual clock), and loses `WeakRef` and
  `FinalizationRegistry`, whose callbacks follow the garbage collector.

Off-heap allocators (ArrayBuffer, typed arrays, WebAssembly memory) escape V8's heap
accounting, so they are removed. Messages wait in an outbox the host drains as JSON.

The program shares the isolate with the bridge and may rewrite any builtin or prototype
first (`String = ...`, `Array.prototype.toJSON = ...`, a setter on `Array.prototype[0]`),
so the bridge uses only what it captured at install time, and the outbox and its
messages are null-prototype arrays, appended to by index: nothing a program changes is
consulted when a message is built or serialized. The host still checks every message's
shape (runner.py): this only keeps a well-behaved program's bridge working.
"""

HOST = "__once_host"  # the bridge object inside V8; non-writable

PRELUDE = r"""
(notify, toolNamesJson, optionsJson) => {
  "use strict";
  const g = globalThis;
  const stringify = JSON.stringify;
  const parse = JSON.parse;
  const toText = String;
  const toNumber = Number;
  const apply = Reflect.apply;
  const then = Promise.prototype.then;
  const withoutPrototype = Object.setPrototypeOf;
  const withResolvers = Promise.withResolvers.bind(Promise);
  const options = JSON.parse(optionsJson);
  const replay = options.replay;
  const outbox = withoutPrototype([], null);
  // By id, in null-prototype objects rather than Maps: Map.prototype is the program's.
  const pending = withoutPrototype({}, null);
  const timers = withoutPrototype({}, null);
  let nextId = 0;
  let done = false;
  const post = (...message) => { outbox[outbox.length] = withoutPrototype(message, null); };
  const ErrorType = Error;
  const asText = (value) => {
    try {
      return toText(value);
    } catch (_e) {
      return "[a value that cannot be shown]";  // its toString throws
    }
  };
  const show = (value) => {
    if (typeof value === "string") return value;
    try {
      if (value instanceof ErrorType) return asText(value);
      const text = stringify(value, (_k, v) => (typeof v === "bigint" ? toText(v) : v));
      return text === undefined ? asText(value) : text;
    } catch (_e) {
      return asText(value);
    }
  };
  const finish = (ok, text) => {
    if (done) return;
    done = true;
    post("done", ok, text);
    notify();
  };
  const callTool = (name, args) => {
    let argsJson;
    try {
      argsJson = stringify(args === undefined ? {} : args);
    } catch (e) {
      return Promise.reject(new TypeError(`arguments of tools.${name}: ${e.message}`));
    }
    const id = nextId++;
    const { promise, resolve, reject } = withResolvers();
    pending[id] = { resolve, reject };
    post("call", id, name, argsJson === undefined ? "null" : argsJson);
    notify();
    return promise;
  };
  const known = {};
  for (const name of parse(toolNamesJson)) known[name] = (args) => callTool(name, args);
  g.tools = new Proxy(Object.freeze(known), {
    get: (target, key) =>
      typeof key !== "string" || key in target || key === "then" || key === "toJSON"
        ? target[key]
        : (args) => callTool(key, args),
  });
  const print = (...values) => {
    let text = "";
    for (let i = 0; i < values.length; i++) text += (i === 0 ? "" : " ") + show(values[i]);
    post("print", text);
  };
  g.print = print;
  g.text = print;
  g.console = Object.freeze({ log: print, info: print, warn: print, error: print, debug: print });
  const fire = (callback) => {
    try {
      callback();
    } catch (error) {
      finish(false, "Uncaught " + show(error));
    }
  };
  let clock = replay ? replay.epochMs : 0;  // a replay's virtual time, in ms
  if (replay) {
    g.setTimeout = (callback, delay, ...args) => {
      const id = nextId++;
      const at = clock + Math.max(0, Number(delay) || 0);
      timers[id] = { at, callback: () => callback(...args) };
      return id;
    };
    let state = replay.seed >>> 0;
    Math.random = () => {
      state = (state + 0x6d2b79f5) >>> 0;
      let t = state;
      t = Math.imul(t ^ (t >>> 15), t | 1);
      t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
    const RealDate = Date;
    function FrozenDate(...args) {
      if (new.target === undefined) return new RealDate(clock).toString();
      return args.length === 0 ? new RealDate(clock) : new RealDate(...args);
    }
    FrozenDate.prototype = RealDate.prototype;
    FrozenDate.now = () => clock;
    FrozenDate.parse = RealDate.parse;
    FrozenDate.UTC = RealDate.UTC;
    Object.defineProperty(RealDate.prototype, "constructor", { value: FrozenDate });
    g.Date = FrozenDate;
    Reflect.deleteProperty(g, "WeakRef");
    Reflect.deleteProperty(g, "FinalizationRegistry");
  } else {
    g.setTimeout = (callback, delay, ...args) => {
      const id = nextId++;
      timers[id] = { callback: () => callback(...args) };
      // As Node does, a delay that is not a number from 1 to 2^31 - 1 ms becomes 1 ms.
      const ms = toNumber(delay);
      post("timer", id, ms >= 1 && ms <= 2147483647 ? ms : 1);
      notify();
      return id;
    };
  }
  g.clearTimeout = (id) => { delete timers[id]; };
  g.__timer_manager = undefined;
  for (const name of [
    "WebAssembly", "ArrayBuffer", "SharedArrayBuffer", "Atomics", "DataView",
    "Int8Array", "Uint8Array", "Uint8ClampedArray", "Int16Array", "Uint16Array",
    "Int32Array", "Uint32Array", "Float16Array", "Float32Array", "Float64Array",
    "BigInt64Array", "BigUint64Array",
  ]) Reflect.deleteProperty(g, name);
  const settle = (id, ok, output) => {
    const call = pending[id];
    if (call === undefined) return;
    delete pending[id];
    if (ok) call.resolve(output);
    else call.reject(new Error(output));
  };
  const host = {
    start: (program) => {
      apply(then, program(), [
        (value) => finish(true, value === undefined ? null : show(value)),
        (error) => finish(false, "Uncaught " + show(error)),
      ]);
    },
    drain: () => {
      const text = stringify(outbox);
      outbox.length = 0;
      return text;
    },
    settle,
    // A replay's round of answers: [[id, ok, output], ...], all settled before any
    // continuation runs.
    settleAll: (answersJson) => {
      const answers = parse(answersJson);
      for (let i = 0; i < answers.length; i++) settle(answers[i][0], answers[i][1], answers[i][2]);
    },
    fire: (id) => {
      const timer = timers[id];
      if (timer === undefined) return;
      delete timers[id];
      fire(timer.callback);
    },
    // A replay's clock moves to the earliest timer (ties: the first set), which fires;
    // false when no timer is left.
    advance: () => {
      let next;
      // for-in visits integer keys in ascending order: the order the timers were set.
      for (const id in timers) if (next === undefined || timers[id].at < timers[next].at) next = id;
      if (next === undefined) return false;
      const timer = timers[next];
      delete timers[next];
      clock = Math.max(clock, timer.at);
      fire(timer.callback);
      return true;
    },
  };
  Object.defineProperty(g, "__once_host", { value: Object.freeze(host) });
}
"""
