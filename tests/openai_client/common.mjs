// Helpers of the official OpenAI client's checks (check.mjs, check_pd.mjs): a check that prints
// a line and counts failures, a metric read from a Prometheus page, a condition awaited, a
// stream read to its end.
// Single-threaded (Node's event loop); `verdict()` ends the process with their verdict.
//   import { check, drain, metric, until, verdict } from './common.mjs';

let failed = 0;

export const check = (cond, what) => {
  console.log(`${cond ? 'ok  ' : 'FAIL'} ${what}`);
  if (!cond) failed++;
};

// The sum of the samples of `name` on the page at `url` whose labels contain `labels` (a
// substring such as 'path="disaggregated"'; '' takes every sample); NaN when there is none.
export const metric = async (url, name, labels = '') => {
  const text = await (await fetch(url)).text();
  let sum = NaN;
  for (const line of text.split('\n')) {
    const m = /^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (!m || m[1] !== name || !(m[2] ?? '').includes(labels)) continue;
    sum = (Number.isNaN(sum) ? 0 : sum) + Number(m[3]);
  }
  return sum;
};

// Polls f() until it holds, for at most `ms`.
export const until = async (f, ms) => {
  const deadline = Date.now() + ms;
  for (;;) {
    if (await f()) return true;
    if (Date.now() > deadline) return false;
    await new Promise(r => setTimeout(r, 20));
  }
};

// Reads an SDK stream of chat.completion.chunk or text_completion chunks to its end: the first
// choice's text, the chunks, the last finish_reason and the usage chunk's usage.
export const drain = async stream => {
  let text = '', chunks = 0, usage = null, finish = null;
  for await (const c of stream) {
    chunks++;
    if (c.choices.length) {
      text += c.choices[0].delta?.content ?? c.choices[0].text ?? '';
      finish = c.choices[0].finish_reason ?? finish;
    }
    if (c.usage) usage = c.usage;
  }
  return { text, chunks, usage, finish };
};

// Prints the verdict and exits 1 if any check failed.
export const verdict = () => {
  console.log(failed ? `${failed} FAILED` : 'all passed');
  process.exit(failed ? 1 : 0);
};
