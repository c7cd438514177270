// ember_build_graphs: LOAD's hot path. Python prepares each graph as flat arrays (op codes,
// argument addresses, attributes, edges; ember/runtime/graphs/prepare_table.py) and this file turns them
// into CUgraphs (and execs) on worker threads. Per node it is one driver call: doing the same
// through ctypes cost ~6 us a node, and the driver builds and instantiates independent graphs
// on several threads at once.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "ember.h"

using namespace ember;

namespace {

struct Failure {
  int status;
  int node;
  CUresult cu;
  std::string msg;
};

void record(ember_graph_desc* d, const Failure& f) {
  d->status = f.status;
  d->failed_node = f.node;
  d->cu_result = static_cast<uint32_t>(f.cu);
  const size_t n = std::min(sizeof d->error - 1, f.msg.size());
  memcpy(d->error, f.msg.data(), n);
  d->error[n] = '\0';
}

std::string cu_name(const Real* r, CUresult rc) {
  const char* s = nullptr;
  if (r->cuGetErrorString && r->cuGetErrorString(rc, &s) == CUDA_SUCCESS && s) return s;
  return strprintf("CUresult %d", static_cast<int>(rc));
}

using EdgeKey = std::tuple<uint32_t, uint32_t, uint8_t, uint8_t, uint8_t>;

// Adds the edges as described in ember.h and verifies edge data by reading it back.
bool add_edges(const Real* r, CUgraph g, const ember_graph_desc* d, const std::vector<CUgraphNode>& nodes,
               Failure* f) {
  if (d->edges == 0) return true;
  std::vector<CUgraphNode> from, to;
  from.reserve(d->edges);
  to.reserve(d->edges);
  bool any_data = false;
  for (uint32_t e = 0; e < d->edges; ++e) {
    if (d->edge_src[e] >= d->nodes || d->edge_dst[e] >= d->nodes) {
      *f = {EMBER_EINVAL, -1, CUDA_SUCCESS, strprintf("edge %u names a node out of range", e)};
      return false;
    }
    const uint8_t* ed = d->edge_data ? d->edge_data + 8 * e : nullptr;
    const bool plain = ed == nullptr || std::all_of(ed, ed + 8, [](uint8_t b) { return b == 0; });
    if (plain) {
      from.push_back(nodes[d->edge_src[e]]);
      to.push_back(nodes[d->edge_dst[e]]);
      continue;
    }
    any_data = true;
    CUgraphEdgeData data;
    static_assert(sizeof data == 8, "CUgraphEdgeData is 8 bytes");
    memcpy(&data, ed, 8);
    const CUgraphNode a = nodes[d->edge_src[e]], b = nodes[d->edge_dst[e]];
    const CUresult rc = r->cuGraphAddDependencies_v2(g, &a, &b, &data, 1);
    if (rc != CUDA_SUCCESS) {
      *f = {EMBER_EDRIVER, -1, rc, strprintf("adding edge %u failed: %s", e, cu_name(r, rc).c_str())};
      return false;
    }
  }
  if (!from.empty()) {
    const CUresult rc = r->cuGraphAddDependencies_v2(g, from.data(), to.data(), nullptr, from.size());
    if (rc != CUDA_SUCCESS) {
      *f = {EMBER_EDRIVER, -1, rc, strprintf("adding %zu edges failed: %s", from.size(), cu_name(r, rc).c_str())};
      return false;
    }
  }
  if (!any_data) return true;
  // Read back: the multiset of (src, dst, from_port, to_port, type) must be what was asked for.
  size_t count = 0;
  CUresult rc = r->cuGraphGetEdges_v2(g, nullptr, nullptr, nullptr, &count);
  std::vector<CUgraphNode> rf(count), rt(count);
  std::vector<CUgraphEdgeData> rd(count);
  if (rc == CUDA_SUCCESS) rc = r->cuGraphGetEdges_v2(g, rf.data(), rt.data(), rd.data(), &count);
  if (rc != CUDA_SUCCESS) {
    *f = {EMBER_EDRIVER, -1, rc, strprintf("reading the edges back failed: %s", cu_name(r, rc).c_str())};
    return false;
  }
  std::unordered_map<CUgraphNode, uint32_t> index;
  index.reserve(nodes.size() * 2);
  for (uint32_t i = 0; i < nodes.size(); ++i) index.emplace(nodes[i], i);
  std::vector<EdgeKey> want, got;
  want.reserve(d->edges);
  got.reserve(count);
  for (uint32_t e = 0; e < d->edges; ++e) {
    const uint8_t* ed = d->edge_data + 8 * e;
    want.emplace_back(d->edge_src[e], d->edge_dst[e], ed[0], ed[1], ed[2]);
  }
  for (size_t e = 0; e < count; ++e) {
    auto a = index.find(rf[e]), b = index.find(rt[e]);
    if (a == index.end() || b == index.end()) {
      *f = {EMBER_EEDGES, -1, CUDA_SUCCESS, "an edge read back names a node not in the graph"};
      return false;
    }
    got.emplace_back(a->second, b->second, rd[e].from_port, rd[e].to_port, rd[e].type);
  }
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  if (want != got) {
    auto nondefault = [](const std::vector<EdgeKey>& v) {
      return std::count_if(v.begin(), v.end(), [](const EdgeKey& k) {
        return std::get<2>(k) || std::get<3>(k) || std::get<4>(k);
      });
    };
    *f = {EMBER_EEDGES, -1, CUDA_SUCCESS,
          strprintf("edge data lost: %zu edges (%ld non-default) read back, %u (%ld non-default) added",
                    got.size(), static_cast<long>(nondefault(got)), d->edges,
                    static_cast<long>(nondefault(want)))};
    return false;
  }
  return true;
}

bool fill(const Real* r, CUcontext ctx, CUgraph g, const ember_graph_desc* d, Failure* f) {
  std::vector<CUgraphNode> nodes(d->nodes, nullptr);
  for (uint32_t i = 0; i < d->nodes; ++i) {
    const uint64_t arg = d->args[i];
    CUresult rc = CUDA_SUCCESS;
    const char* what = "node";
    switch (d->ops[i]) {
      case EMBER_OP_KERNEL: {
        what = "kernel node";
        rc = r->cuGraphAddKernelNode_v2(&nodes[i], g, nullptr, 0,
                                        reinterpret_cast<const CUDA_KERNEL_NODE_PARAMS*>(arg));
        if (rc != CUDA_SUCCESS || d->attr_count == nullptr) break;
        const uint32_t a0 = d->attr_start[i], an = d->attr_count[i];
        for (uint32_t a = a0; a < a0 + an && rc == CUDA_SUCCESS; ++a) {
          what = "kernel node attribute";
          rc = r->cuGraphKernelNodeSetAttribute(
              nodes[i], static_cast<CUkernelNodeAttrID>(d->attr_ids[a]),
              reinterpret_cast<const CUkernelNodeAttrValue*>(d->attr_values[a]));
        }
        break;
      }
      case EMBER_OP_MEMSET:
        what = "memset node";
        rc = r->cuGraphAddMemsetNode(&nodes[i], g, nullptr, 0,
                                     reinterpret_cast<const CUDA_MEMSET_NODE_PARAMS*>(arg), ctx);
        break;
      case EMBER_OP_MEMCPY:
        what = "memcpy node";
        rc = r->cuGraphAddMemcpyNode(&nodes[i], g, nullptr, 0, reinterpret_cast<const CUDA_MEMCPY3D*>(arg), ctx);
        break;
      case EMBER_OP_EMPTY:
        what = "empty node";
        rc = r->cuGraphAddEmptyNode(&nodes[i], g, nullptr, 0);
        break;
      case EMBER_OP_RECORD:
        what = "event record node";
        rc = r->cuGraphAddEventRecordNode(&nodes[i], g, nullptr, 0, reinterpret_cast<CUevent>(arg));
        break;
      case EMBER_OP_WAIT:
        what = "event wait node";
        rc = r->cuGraphAddEventWaitNode(&nodes[i], g, nullptr, 0, reinterpret_cast<CUevent>(arg));
        break;
      case EMBER_OP_CHILD:
        what = "child graph node";
        rc = r->cuGraphAddChildGraphNode(&nodes[i], g, nullptr, 0, reinterpret_cast<CUgraph>(arg));
        break;
      default:
        *f = {EMBER_EINVAL, static_cast<int>(i), CUDA_SUCCESS, strprintf("unknown op %u", d->ops[i])};
        return false;
    }
    if (rc != CUDA_SUCCESS) {
      *f = {EMBER_EDRIVER, static_cast<int>(i), rc,
            strprintf("node %u: adding the %s failed: %s", i, what, cu_name(r, rc).c_str())};
      return false;
    }
  }
  if (!add_edges(r, g, d, nodes, f)) return false;
  if (d->node_handles != nullptr)  // a union template's nodes are enabled one by one later
    for (uint32_t i = 0; i < d->nodes; ++i) d->node_handles[i] = reinterpret_cast<uint64_t>(nodes[i]);
  return true;
}

void build_one(const Real* r, CUcontext ctx, ember_graph_desc* d) {
  d->status = EMBER_OK;
  d->failed_node = -1;
  d->cu_result = 0;
  d->graph = d->exec = 0;
  d->error[0] = '\0';
  if (d->nodes > 0 && (d->ops == nullptr || d->args == nullptr)) {
    record(d, {EMBER_EINVAL, -1, CUDA_SUCCESS, "ops and args are required"});
    return;
  }
  if (d->edges > 0 && (d->edge_src == nullptr || d->edge_dst == nullptr)) {
    record(d, {EMBER_EINVAL, -1, CUDA_SUCCESS, "edge_src and edge_dst are required"});
    return;
  }
  uint64_t t0 = now_ns();
  CUgraph g = nullptr;
  CUresult rc = r->cuGraphCreate(&g, 0);
  if (rc != CUDA_SUCCESS) {
    record(d, {EMBER_EDRIVER, -1, rc, "cuGraphCreate failed: " + cu_name(r, rc)});
    return;
  }
  Failure f{};
  if (!fill(r, ctx, g, d, &f)) {
    r->cuGraphDestroy(g);
    record(d, f);
    return;
  }
  d->build_ns = now_ns() - t0;
  if (d->flags & EMBER_BUILD_INSTANTIATE) {
    t0 = now_ns();
    CUgraphExec ex = nullptr;
    rc = r->cuGraphInstantiateWithFlags(&ex, g, 0);
    if (rc != CUDA_SUCCESS) {
      r->cuGraphDestroy(g);
      record(d, {EMBER_EDRIVER, -1, rc, "cuGraphInstantiateWithFlags failed: " + cu_name(r, rc)});
      return;
    }
    d->exec = reinterpret_cast<uint64_t>(ex);
    d->instantiate_ns = now_ns() - t0;
  }
  d->graph = reinterpret_cast<uint64_t>(g);
}

}  // namespace

extern "C" EMBER_EXPORT int ember_build_graphs(uint64_t ctx, ember_graph_desc* graphs, size_t n, int threads) {
  if (graphs == nullptr && n > 0) {
    set_last_error("ember_build_graphs: graphs is NULL");
    return EMBER_EINVAL;
  }
  const Real* r = real();
  if (r == nullptr || r->cuGraphCreate == nullptr || r->cuGraphAddKernelNode_v2 == nullptr ||
      r->cuGraphAddDependencies_v2 == nullptr || r->cuGraphGetEdges_v2 == nullptr ||
      r->cuGraphInstantiateWithFlags == nullptr) {
    set_last_error("ember_build_graphs: the driver lacks the graph entry points (CUDA >= 12.3 needed)");
    return EMBER_ENODRIVER;
  }
  CUcontext c = reinterpret_cast<CUcontext>(ctx);
  std::atomic<size_t> next{0};
  auto work = [&] {
    if (r->cuCtxSetCurrent(c) != CUDA_SUCCESS) return;  // graphs left unclaimed are reported below
    for (size_t i; (i = next.fetch_add(1)) < n;) build_one(r, c, &graphs[i]);
  };
  const size_t workers = std::max<size_t>(1, std::min<size_t>(n, threads > 0 ? threads : 1));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < workers; ++t) pool.emplace_back(work);
  work();  // the calling thread works too (its current context is set the same way)
  for (auto& t : pool) t.join();
  if (next.load() < n) {  // a worker could not make the context current: build the rest here
    for (size_t i = next.load(); i < n; ++i) build_one(r, c, &graphs[i]);
  }
  // A graph the driver refused fails the whole batch: nothing of it is kept. Edge data the driver
  // dropped fails only that graph (the caller builds it another way).
  int first = -1;
  for (size_t i = 0; i < n && first < 0; ++i)
    if (graphs[i].status != EMBER_OK && graphs[i].status != EMBER_EEDGES) first = static_cast<int>(i);
  if (first >= 0) {
    for (size_t i = 0; i < n; ++i) {
      if (graphs[i].exec) r->cuGraphExecDestroy(reinterpret_cast<CUgraphExec>(graphs[i].exec));
      if (graphs[i].graph) r->cuGraphDestroy(reinterpret_cast<CUgraph>(graphs[i].graph));
      graphs[i].exec = graphs[i].graph = 0;
    }
    set_last_error(strprintf("graph %d: %s", first, graphs[first].error));
    return graphs[first].status;
  }
  for (size_t i = 0; i < n; ++i) {
    if (graphs[i].status != EMBER_OK) {
      set_last_error(strprintf("graph %zu: %s", i, graphs[i].error));
      return graphs[i].status;
    }
  }
  return EMBER_OK;
}

extern "C" EMBER_EXPORT int ember_exec_enable(uint64_t exec, const uint64_t* nodes, const uint8_t* on, size_t n,
                                             size_t* failed) {
  if (n > 0 && (exec == 0 || nodes == nullptr || on == nullptr)) {
    set_last_error("ember_exec_enable: exec, nodes and on are required");
    return EMBER_EINVAL;
  }
  const Real* r = real();
  if (r == nullptr || r->cuGraphNodeSetEnabled == nullptr) {
    set_last_error("ember_exec_enable: the driver lacks cuGraphNodeSetEnabled");
    return EMBER_ENODRIVER;
  }
  for (size_t i = 0; i < n; ++i) {
    const CUresult rc = r->cuGraphNodeSetEnabled(reinterpret_cast<CUgraphExec>(exec),
                                                 reinterpret_cast<CUgraphNode>(nodes[i]), on[i] ? 1u : 0u);
    if (rc != CUDA_SUCCESS) {
      if (failed) *failed = i;
      set_last_error(strprintf("ember_exec_enable: node %zu: %s", i, cu_name(r, rc).c_str()));
      return EMBER_EDRIVER;
    }
  }
  return EMBER_OK;
}
