// The official OpenAI client (Node SDK) through a disaggregated fleet: run by
// scripts/openai-client-check.sh after check.mjs, against model `mock-pd`, served by kvmocker
// workers of role prefill and decode (nixl legs). The router keeps its default policy; the decode
// engines announce a small prefill budget per step, so a local prefill on one is predicted
// slower than the prefill pool for every prompt here and each request takes both legs.
// Arguments: the gateway's base URL (".../v1"), the router's /metrics, the prefill engine's own
// base URL (".../v1"), the prefill kvmocker's /metrics, the prefill worker ids and the decode
// worker ids (each comma-separated), the gateway's /metrics (on its --metrics-port). Prints a line
// per check; exits 1 if any failed.
import OpenAI from 'openai';
import { check, drain, metric, until, verdict } from './common.mjs';

const [base, routerMetrics, prefillBase, prefillMetrics, prefillIdList, decodeIdList, gatewayMetrics] =
  process.argv.slice(2);
const prefillIds = prefillIdList.split(',');
const decodeIds = decodeIdList.split(',');
const client = new OpenAI({ baseURL: base, apiKey: 'unused', maxRetries: 0 });
const model = 'mock-pd';
const disagg = path => metric(gatewayMetrics, 'kvgateway_disagg_requests_total', `path="${path}"`);
const count = v => (Number.isNaN(v) ? 0 : v);  // a labelled series is absent until its first count

// Both legs ran: the prefill engine is named apart from the decode engine that answered.
const legs = (response, what) => {
  const prefill = response.headers.get('x-kvrouter-prefill-worker-id');
  const decode = response.headers.get('x-kvrouter-worker-id');
  check(prefillIds.includes(prefill) && decodeIds.includes(decode),
        `${what}: x-kvrouter-prefill-worker-id ${prefill} (prefill ${prefillIds}), ` +
          `x-kvrouter-worker-id ${decode} (decode ${decodeIds})`);
};
// A prompt no engine holds a block of: its first block is unique (kvmocker tokenizes bytes).
const fresh = what => `${what} ${Date.now()} `.padEnd(80, '.') + ' Tell me about disaggregated serving.';

const models = await client.models.list();
check(models.data.some(m => m.id === model), `models.list has ${model}`);
// check.mjs ran the aggregated model's requests: none was eligible.
const before = { disaggregated: count(await disagg('disaggregated')), local: count(await disagg('local')),
                 fallback: count(await disagg('fallback')) };
check(before.disaggregated + before.local + before.fallback === 0,
      `the aggregated model's requests are not counted in kvgateway_disagg_requests_total (${JSON.stringify(before)})`);
let sent = 0;

{
  const { data: chat, response } = await client.chat.completions
    .create({ model, messages: [{ role: 'user', content: fresh('chat') }], max_tokens: 8 })
    .withResponse();
  sent++;
  check(chat.object === 'chat.completion' && chat.choices[0].message.content.length > 0 &&
          chat.choices[0].finish_reason === 'length' && chat.usage.completion_tokens === 8 &&
          chat.usage.prompt_tokens_details?.cached_tokens === 0,
        `P/D chat: ${JSON.stringify(chat).slice(0, 200)}`);
  legs(response, 'P/D chat');
  check(chat._request_id && chat._request_id === response.headers.get('x-request-id'),
        `P/D chat: x-request-id as the SDK reads it: ${chat._request_id}`);
}
{
  const { data: stream, response } = await client.chat.completions
    .create({ model, messages: [{ role: 'user', content: fresh('chat streamed') }], max_tokens: 16, stream: true,
              stream_options: { include_usage: true } })
    .withResponse();
  sent++;
  const { text, chunks, usage, finish } = await drain(stream);
  check(chunks > 2 && text.length > 0 && finish === 'length' && usage?.completion_tokens === 16,
        `P/D chat streamed: ${chunks} chunks, ${JSON.stringify(text)}, usage ${JSON.stringify(usage)}`);
  legs(response, 'P/D chat streamed');
}
{
  const { data: comp, response } = await client.completions
    .create({ model, prompt: fresh('completion'), max_tokens: 8 })
    .withResponse();
  sent++;
  check(comp.object === 'text_completion' && comp.choices[0].text.length > 0 &&
          comp.choices[0].finish_reason === 'length' && comp.usage.completion_tokens === 8,
        `P/D completions: ${JSON.stringify(comp).slice(0, 200)}`);
  legs(response, 'P/D completions');
}
{
  const { data: stream, response } = await client.completions
    .create({ model, prompt: fresh('completion streamed'), max_tokens: 12, stream: true,
              stream_options: { include_usage: true } })
    .withResponse();
  sent++;
  const { text, chunks, usage, finish } = await drain(stream);
  check(chunks > 2 && text.length > 0 && finish === 'length' && usage?.completion_tokens === 12,
        `P/D completions streamed: ${chunks} chunks, ${JSON.stringify(text)}, usage ${JSON.stringify(usage)}`);
  legs(response, 'P/D completions streamed');
}

// cached_tokens is the prefill engine's: the prompt is put in the prefill engine's cache by a
// request to that engine alone, so the prefill leg hits it while the decode engine, which never
// saw the prompt, would report 0.
{
  const messages = [{ role: 'system', content: fresh('cached') + 'You are a helpful assistant. '.repeat(60) },
                    { role: 'user', content: 'q' }];
  const length = messages[0].content.length;
  const direct = new OpenAI({ baseURL: prefillBase, apiKey: 'unused', maxRetries: 0 });
  await direct.chat.completions.create({ model, messages, max_tokens: 1 });
  const { data: chat, response } = await client.chat.completions.create({ model, messages, max_tokens: 4 }).withResponse();
  sent++;
  const cached = chat.usage?.prompt_tokens_details?.cached_tokens ?? 0;
  check(cached >= length * 0.9 && chat.usage.completion_tokens === 4,
        `P/D cached_tokens ${cached} of a ${length}-token prompt the prefill engine holds (usage ${JSON.stringify(chat.usage)})`);
  legs(response, 'P/D cached_tokens');
}

// The client goes away mid-stream: every leg closes, both bookings go, the prefill engine's pins
// end (by the decode engine's notice, else at the prefill engine's short --kv-lease-ms).
{
  const gone = await metric(gatewayMetrics, 'kvgateway_clients_gone_total');
  const ac = new AbortController();
  const { data: long, response } = await client.chat.completions
    .create({ model, messages: [{ role: 'user', content: fresh('a long answer') }], max_tokens: 4000, stream: true },
            { signal: ac.signal })
    .withResponse();
  sent++;
  legs(response, 'P/D aborted stream');
  let got = 0, thrown = null;
  try {
    for await (const _ of long) if (++got === 3) ac.abort();
  } catch (e) {
    thrown = e;
  }
  check(thrown === null || thrown instanceof OpenAI.APIUserAbortError,
        `P/D abort ends the stream (${thrown?.constructor.name ?? 'no error'})`);
  const freed = await until(async () =>
    await metric(gatewayMetrics, 'kvgateway_clients_gone_total') === gone + 1 &&
    await metric(gatewayMetrics, 'kvgateway_requests_in_flight') === 0 &&
    await metric(routerMetrics, 'kvrouter_active_requests') === 0 &&
    await metric(routerMetrics, 'kvrouter_worker_active_requests') === 0 &&
    await metric(routerMetrics, 'kvrouter_worker_active_prefill_tokens') === 0, 10000);
  check(got >= 3 && freed, `P/D: an aborted stream (${got} chunks) is counted gone and both its bookings freed`);
  const unpinned = await until(async () => await metric(prefillMetrics, 'kvmocker_pinned_blocks') === 0, 10000);
  check(unpinned, `P/D: the prefill engine pins no block (kvmocker_pinned_blocks ${
    await metric(prefillMetrics, 'kvmocker_pinned_blocks')})`);
}

const after = { disaggregated: count(await disagg('disaggregated')), local: count(await disagg('local')),
                fallback: count(await disagg('fallback')) };
check(after.disaggregated === before.disaggregated + sent && after.local === before.local &&
        after.fallback === before.fallback,
      `kvgateway_disagg_requests_total counts ${sent} requests disaggregated: ${JSON.stringify(after)}`);

verdict();
