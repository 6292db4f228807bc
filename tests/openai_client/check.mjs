// The official OpenAI client (Node SDK) against kvgateway: run by scripts/openai-client-check.sh,
// which starts the system. Arguments: the gateway's base URL (".../v1"), the router's /metrics and
// the gateway's /metrics (on its --metrics-port).
// Prints a line per check; exits 1 if any failed.
import OpenAI from 'openai';
import { check, drain, metric, until, verdict } from './common.mjs';

const [base, routerMetrics, gatewayMetrics] = process.argv.slice(2);
const client = new OpenAI({ baseURL: base, apiKey: 'unused', maxRetries: 0 });

const models = await client.models.list();
check(models.data.some(m => m.id === 'mock'), `models.list: ${JSON.stringify(models.data)}`);

const { data: chat, response } = await client.chat.completions
  .create({ model: 'mock', messages: [{ role: 'user', content: 'Hello there!' }], max_tokens: 8 })
  .withResponse();
check(chat.object === 'chat.completion' && chat.choices[0].message.content.length > 0 &&
        chat.choices[0].finish_reason === 'length' && chat.usage.completion_tokens === 8,
      `chat: ${JSON.stringify(chat).slice(0, 160)}`);
check(/^\d+$/.test(response.headers.get('x-kvrouter-worker-id') ?? '') &&
        response.headers.get('x-kvrouter-cached-tokens') !== null,
      `x-kvrouter-worker-id ${response.headers.get('x-kvrouter-worker-id')}`);
check(chat._request_id && chat._request_id === response.headers.get('x-request-id'),
      `x-request-id as the SDK reads it: ${chat._request_id}`);

const stream = await client.chat.completions.create({
  model: 'mock', messages: [{ role: 'user', content: 'Stream to me' }], max_tokens: 16, stream: true,
  stream_options: { include_usage: true } });
const { text, chunks, usage, finish } = await drain(stream);
check(chunks > 2 && text.length > 0 && finish === 'length' && usage?.completion_tokens === 16,
      `chat streamed: ${chunks} chunks, ${JSON.stringify(text)}, usage ${JSON.stringify(usage)}`);

const comp = await client.completions.create({ model: 'mock', prompt: 'Once upon a time', max_tokens: 8 });
check(comp.object === 'text_completion' && comp.choices[0].text.length > 0, `completions: ${JSON.stringify(comp).slice(0, 120)}`);
const cstream = await client.completions.create({ model: 'mock', prompt: 'Once upon a time', max_tokens: 8, stream: true });
const { text: ctext, chunks: cchunks } = await drain(cstream);
check(cchunks > 1 && ctext.length > 0, `completions streamed: ${cchunks} chunks, ${JSON.stringify(ctext)}`);

// A long shared prefix: once the router has the first answer's blocks, the engine it picks has it.
const system = 'You are a helpful assistant. '.repeat(200);
let cached = 0, asked = 0;
await until(async () => {
  const r = await client.chat.completions.create({
    model: 'mock', messages: [{ role: 'system', content: system }, { role: 'user', content: `q${asked++}` }], max_tokens: 2 });
  cached = r.usage?.prompt_tokens_details?.cached_tokens ?? 0;
  return cached >= system.length * 0.9;  // kvmocker tokenizes bytes
}, 10000);
check(cached >= system.length * 0.9, `cached_tokens ${cached} of a ${system.length}-token prefix (request ${asked})`);

try {
  await client.chat.completions.create({ model: 'nope', messages: [{ role: 'user', content: 'x' }] });
  check(false, 'an unknown model was answered');
} catch (e) {
  check(e instanceof OpenAI.NotFoundError && e.code === 'model_not_found', `unknown model: ${e.constructor.name} ${e.status} ${e.code}`);
}
try {
  await client.chat.completions.create({ model: 'mock' });
  check(false, 'a request without messages was answered');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.type === 'invalid_request_error', `no messages: ${e.constructor.name} ${e.status} ${e.type}`);
}

// The client goes away mid-stream: the gateway frees the booking.
const gone = await metric(gatewayMetrics, 'kvgateway_clients_gone_total');
const ac = new AbortController();
const long = await client.chat.completions.create(
  { model: 'mock', messages: [{ role: 'user', content: 'a long answer' }], max_tokens: 4000, stream: true },
  { signal: ac.signal });
let got = 0, thrown = null;
try {
  for await (const _ of long) if (++got === 3) ac.abort();
} catch (e) {
  thrown = e;
}
// The SDK ends the iteration, or throws its abort error: nothing else.
check(thrown === null || thrown instanceof OpenAI.APIUserAbortError, `abort ends the stream (${thrown?.constructor.name ?? 'no error'})`);
const freed = await until(async () =>
  await metric(gatewayMetrics, 'kvgateway_clients_gone_total') === gone + 1 &&
  await metric(gatewayMetrics, 'kvgateway_requests_in_flight') === 0 &&
  await metric(routerMetrics, 'kvrouter_active_requests') === 0, 10000);
check(got >= 3 && freed, `an aborted stream (${got} chunks) is counted gone and its booking freed`);

verdict();
