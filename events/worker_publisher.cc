#include "events/worker_publisher.h"

#include <algorithm>
#include <string>
#include <utility>

namespace kvrouter {

KvEventPublisher::KvEventPublisher(PublisherConfig config) : config_(config), nodes_(1) {
  ring_.reserve(std::min<std::size_t>(config_.event_buffer, 1024));
}

KvEventBatch KvEventPublisher::Batch(std::uint64_t event_id, KvOp op) const {
  KvEventBatch batch{
      .worker_id = config_.worker_id, .dp_rank = config_.dp_rank, .sequence = {SequenceKind::kEventId, event_id}};
  batch.ops.push_back(std::move(op));
  return batch;
}

KvEventBatch KvEventPublisher::Publish(KvEventData data, StorageTier tier) {
  KvEventBatch batch = Batch(++last_event_id_, KvOp{tier, std::move(data)});
  Apply(batch.ops.front());
  Remember(batch);
  return batch;
}

// ---------------------------------------------------------------------------------------------
// Ring buffer.

void KvEventPublisher::Remember(const KvEventBatch& batch) {
  const std::size_t capacity = config_.event_buffer;
  if (capacity == 0) return;
  if (ring_.size() < capacity) {
    ring_.push_back(batch);
    return;
  }
  ring_[ring_first_] = batch;
  ring_first_ = (ring_first_ + 1) % capacity;
}

const KvEventBatch& KvEventPublisher::Buffered(std::size_t i) const { return ring_[(ring_first_ + i) % ring_.size()]; }

// ---------------------------------------------------------------------------------------------
// Index.

std::uint32_t KvEventPublisher::Find(BlockHash block_hash) const {
  auto it = node_of_.find(block_hash);
  return it == node_of_.end() ? kNone : it->second;
}

std::uint32_t KvEventPublisher::AddChild(std::uint32_t parent, const StoredBlock& block) {
  std::uint32_t n;
  if (!free_nodes_.empty()) {
    n = free_nodes_.back();
    free_nodes_.pop_back();
  } else {
    n = static_cast<std::uint32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& node = nodes_[n];
  node = Node{.block_hash = block.block_hash,
              .tokens_hash = block.tokens_hash,
              .parent = parent,
              .next_sibling = nodes_[parent].first_child};
  if (node.next_sibling != kNone) nodes_[node.next_sibling].prev_sibling = n;
  nodes_[parent].first_child = n;
  node_of_.emplace(block.block_hash, n);
  return n;
}

void KvEventPublisher::DropSubtree(std::uint32_t top) {
  // Unlink the top from its parent's children; everything below goes with it.
  Node& t = nodes_[top];
  if (t.prev_sibling != kNone) {
    nodes_[t.prev_sibling].next_sibling = t.next_sibling;
  } else {
    nodes_[t.parent].first_child = t.next_sibling;
  }
  if (t.next_sibling != kNone) nodes_[t.next_sibling].prev_sibling = t.prev_sibling;

  std::vector<std::uint32_t> pending = {top};
  while (!pending.empty()) {
    const std::uint32_t n = pending.back();
    pending.pop_back();
    for (std::uint32_t c = nodes_[n].first_child; c != kNone; c = nodes_[c].next_sibling) {
      pending.push_back(c);
    }
    node_of_.erase(nodes_[n].block_hash);
    nodes_[n] = Node{};
    free_nodes_.push_back(n);
  }
}

void KvEventPublisher::Clear() {
  nodes_.assign(1, Node{});
  free_nodes_.clear();
  node_of_.clear();
}

void KvEventPublisher::ApplyStored(const KvStored& stored) {
  std::uint32_t parent = kRoot;
  if (stored.parent_hash) {
    parent = Find(*stored.parent_hash);
    if (parent == kNone) return;  // not indexed, like the router does
  }
  for (const StoredBlock& block : stored.blocks) {
    const std::uint32_t known = Find(block.block_hash);
    if (known != kNone) {
      const Node& k = nodes_[known];
      if (k.parent == parent && k.tokens_hash == block.tokens_hash) {  // stored again: no-op
        parent = known;
        continue;
      }
      // Stored at another place: the old place and what hangs below it go. The new parent may
      // have hung below it too; then the rest of the chain has no parent.
      const BlockHash parent_hash = nodes_[parent].block_hash;
      DropSubtree(known);
      if (parent != kRoot && Find(parent_hash) != parent) return;
    }
    parent = AddChild(parent, block);
  }
}

void KvEventPublisher::Apply(const KvOp& op) {
  if (std::holds_alternative<KvCleared>(op.data)) {
    Clear();
    return;
  }
  if (op.tier != StorageTier::kDevice) return;
  if (const auto* stored = std::get_if<KvStored>(&op.data)) {
    ApplyStored(*stored);
    return;
  }
  for (BlockHash h : std::get<KvRemoved>(op.data).block_hashes) {
    if (const std::uint32_t n = Find(h); n != kNone) DropSubtree(n);
  }
}

std::vector<HeldBlock> KvEventPublisher::HeldBlocks() const {
  std::vector<HeldBlock> out;
  out.reserve(node_of_.size());
  for (const auto& [hash, n] : node_of_) {
    const Node& node = nodes_[n];
    HeldBlock b{.block_hash = hash, .tokens_hash = node.tokens_hash};
    if (node.parent != kRoot) b.parent_hash = nodes_[node.parent].block_hash;
    out.push_back(b);
  }
  std::sort(out.begin(), out.end(), [](const HeldBlock& a, const HeldBlock& b) { return a.block_hash < b.block_hash; });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Recovery.

RecoveryReply KvEventPublisher::Answer(const Result<RecoveryQuery>& query) const {
  if (query.ok()) return Recover(query->start_event_id, query->end_event_id);
  return {.kind = "error", .last_event_id = last_event_id_, .message = query.status().message()};
}

RecoveryReply KvEventPublisher::Recover(std::optional<std::uint64_t> start, std::optional<std::uint64_t> end) const {
  RecoveryReply reply;
  reply.last_event_id = last_event_id_;
  if (start && end && *end < *start) {
    reply.kind = "invalid_range";
    reply.message = "end_event_id " + std::to_string(*end) + " < start_event_id " + std::to_string(*start);
    return reply;
  }
  if (start && *start > last_event_id_) {
    reply.kind = "too_new";
    reply.message = "start_event_id " + std::to_string(*start) + " > last_event_id " + std::to_string(last_event_id_);
    return reply;
  }
  const std::uint64_t oldest = last_event_id_ - ring_.size() + 1;  // the buffer ends at last
  if (start && !ring_.empty() && *start >= oldest) {
    reply.kind = "events";
    const std::uint64_t last = end ? std::min(*end, last_event_id_) : last_event_id_;
    reply.events.reserve(last - *start + 1);
    for (std::uint64_t id = *start; id <= last; ++id) reply.events.push_back(Buffered(id - oldest));
    return reply;
  }

  // Tree dump: a depth-first walk. A chain follows each block's first child; the other children
  // start chains of their own, emitted after the chain that holds their parent.
  reply.kind = "tree_dump";
  std::vector<std::uint32_t> heads;
  for (std::uint32_t c = nodes_[kRoot].first_child; c != kNone; c = nodes_[c].next_sibling) {
    heads.push_back(c);
  }
  while (!heads.empty()) {
    std::uint32_t cur = heads.back();
    heads.pop_back();
    KvStored chain;
    if (nodes_[cur].parent != kRoot) chain.parent_hash = nodes_[nodes_[cur].parent].block_hash;
    for (;;) {
      const Node& node = nodes_[cur];
      chain.blocks.push_back({node.block_hash, node.tokens_hash});
      if (node.first_child == kNone) break;
      for (std::uint32_t s = nodes_[node.first_child].next_sibling; s != kNone; s = nodes_[s].next_sibling) {
        heads.push_back(s);
      }
      cur = node.first_child;
    }
    reply.events.push_back(Batch(last_event_id_, KvOp{StorageTier::kDevice, std::move(chain)}));
  }
  return reply;
}

}  // namespace kvrouter
