// memory.html: one self-contained page (no network): a stacked-area SVG of memory by tag over time
// drawn here in C++ (so it renders even with scripts off), forward/backward/optimizer bands, the
// budget and reserved lines, the tables of memory.json, and the JSON itself embedded for tools.
// A few lines of inline script add a hover read-out.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "kestrel/runtime/memory_budget.h"
#include "kestrel/train/memory_profile.h"

namespace kestrel::train {

namespace {

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

// Stack order (bottom to top) and colours.
constexpr MemoryTag kStack[] = {MemoryTag::External,   MemoryTag::Parameter,  MemoryTag::OptimizerState,
                                MemoryTag::Gradient,   MemoryTag::Activation, MemoryTag::Checkpoint,
                                MemoryTag::Workspace,  MemoryTag::Loss,       MemoryTag::Temporary};
const char* colour(MemoryTag t) {
  switch (t) {
    case MemoryTag::Parameter: return "#4e79a7";
    case MemoryTag::Gradient: return "#f28e2b";
    case MemoryTag::OptimizerState: return "#76b7b2";
    case MemoryTag::Activation: return "#e15759";
    case MemoryTag::Checkpoint: return "#59a14f";
    case MemoryTag::Workspace: return "#edc948";
    case MemoryTag::Loss: return "#b07aa1";
    case MemoryTag::Temporary: return "#ff9da7";
    case MemoryTag::External: return "#9c755f";
  }
  return "#999";
}
const char* band_colour(const std::string& n) {
  if (n == "forward") return "#dbe9f6";
  if (n == "backward") return "#fde5cc";
  return "#dff0d8";
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

void chart(std::ostringstream& os, const MemoryProfile& p) {
  const double W = 1200, H = 440, L = 90, R = 20, T = 20, B = 50;
  const double pw = W - L - R, ph = H - T - B;
  const size_t n = p.t.size();
  double tmax = n ? std::max(p.t.back(), 1e-9) : 1.0;
  for (const PhaseSpan& s : p.spans) tmax = std::max(tmax, s.t1);
  int64_t ymax_b = p.peak_in_use + p.external;
  for (int64_t r : p.reserved) ymax_b = std::max(ymax_b, r + p.external);
  if (p.budget > 0) ymax_b = std::max(ymax_b, p.budget);
  const double ymax = std::max<double>(1.0, static_cast<double>(ymax_b) * 1.08);
  auto X = [&](double t) { return L + pw * t / tmax; };
  auto Y = [&](double b) { return T + ph * (1.0 - b / ymax); };

  os << "<svg id=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
     << "\" viewBox=\"0 0 " << W << " " << H << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  os << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << pw << "\" height=\"" << ph << "\" fill=\"#fff\" stroke=\"#ccc\"/>\n";
  for (const PhaseSpan& s : p.spans)
    os << "<rect class=\"band\" data-phase=\"" << esc(s.name) << "\" x=\"" << num(X(s.t0)) << "\" y=\"" << T
       << "\" width=\"" << num(std::max(0.5, X(s.t1) - X(s.t0))) << "\" height=\"" << ph << "\" fill=\""
       << band_colour(s.name) << "\"/>\n";
  // Stacked areas.
  std::vector<double> lower(n, 0.0), upper(n, 0.0);
  for (MemoryTag tag : kStack) {
    const auto& v = p.by_tag[static_cast<int>(tag)];
    bool any = false;
    for (size_t i = 0; i < n; ++i) {
      upper[i] = lower[i] + static_cast<double>(v[i]);
      any |= v[i] != 0;
    }
    if (any) {
      os << "<path class=\"area\" data-tag=\"" << tag_name(tag) << "\" fill=\"" << colour(tag)
         << "\" fill-opacity=\"0.85\" d=\"";
      for (size_t i = 0; i < n; ++i) os << (i ? "L" : "M") << num(X(p.t[i])) << "," << num(Y(upper[i]));
      for (size_t i = n; i-- > 0;) os << "L" << num(X(p.t[i])) << "," << num(Y(lower[i]));
      os << "Z\"><title>" << tag_name(tag) << "</title></path>\n";
    }
    lower = upper;
  }
  // Reserved (+ external) line, budget line, the peak marker.
  if (n && *std::max_element(p.reserved.begin(), p.reserved.end()) > 0) {
    os << "<polyline class=\"reserved\" fill=\"none\" stroke=\"#333\" stroke-dasharray=\"4 3\" points=\"";
    for (size_t i = 0; i < n; ++i) os << num(X(p.t[i])) << "," << num(Y(static_cast<double>(p.reserved[i] + p.external))) << " ";
    os << "\"><title>reserved + external</title></polyline>\n";
  }
  if (p.budget > 0)
    os << "<line class=\"budget\" x1=\"" << L << "\" x2=\"" << L + pw << "\" y1=\"" << num(Y(p.budget)) << "\" y2=\""
       << num(Y(p.budget)) << "\" stroke=\"#d62728\" stroke-width=\"2\" stroke-dasharray=\"8 4\"/>"
       << "<text x=\"" << L + pw - 4 << "\" y=\"" << num(Y(p.budget) - 4) << "\" text-anchor=\"end\" fill=\"#d62728\">budget "
       << esc(format_bytes(p.budget)) << "</text>\n";
  os << "<circle class=\"peak\" cx=\"" << num(X(p.peak_time_s)) << "\" cy=\"" << num(Y(p.peak_in_use + p.external))
     << "\" r=\"4\" fill=\"#000\"/><text x=\"" << num(X(p.peak_time_s) + 6) << "\" y=\""
     << num(Y(p.peak_in_use + p.external) - 6) << "\">peak " << esc(format_bytes(p.peak_in_use + p.external)) << "</text>\n";
  // Axes.
  for (int k = 0; k <= 5; ++k) {
    double b = ymax * k / 5.0;
    os << "<line x1=\"" << L - 4 << "\" x2=\"" << L + pw << "\" y1=\"" << num(Y(b)) << "\" y2=\"" << num(Y(b))
       << "\" stroke=\"#000\" stroke-opacity=\"0.08\"/><text x=\"" << L - 6 << "\" y=\"" << num(Y(b) + 4)
       << "\" text-anchor=\"end\">" << esc(format_bytes(static_cast<int64_t>(b))) << "</text>\n";
    double t = tmax * k / 5.0;
    char tb[32];
    std::snprintf(tb, sizeof tb, "%.3g s", t);
    os << "<text x=\"" << num(X(t)) << "\" y=\"" << T + ph + 16 << "\" text-anchor=\"middle\">" << tb << "</text>\n";
  }
  os << "<text x=\"" << L + pw / 2 << "\" y=\"" << H - 8 << "\" text-anchor=\"middle\">time since profiling began</text>\n";
  os << "<line id=\"cursor\" x1=\"0\" x2=\"0\" y1=\"" << T << "\" y2=\"" << T + ph << "\" stroke=\"#000\" visibility=\"hidden\"/>\n";
  os << "</svg>\n";
  // Legend.
  os << "<div class=\"legend\">";
  for (MemoryTag tag : kStack)
    os << "<span><i style=\"background:" << colour(tag) << "\"></i>" << tag_name(tag) << "</span>";
  os << "<span><i style=\"background:#dbe9f6\"></i>forward</span><span><i style=\"background:#fde5cc\"></i>backward</span>"
        "<span><i style=\"background:#dff0d8\"></i>optimizer</span><span><i style=\"background:#d62728;height:3px\"></i>budget</span>"
        "<span><i style=\"background:#333;height:2px\"></i>reserved + external</span></div>\n";
  os << "<div id=\"readout\">hover the chart for bytes by tag</div>\n";
}

void tables(std::ostringstream& os, const MemoryProfile& p) {
  os << "<h2>By tag</h2><table><tr><th>tag</th><th>peak</th><th>at the global peak</th><th>at the end</th>";
  const bool planned = p.plan.is_object();
  if (planned) os << "<th>planned peak</th><th>plan / measured</th>";
  os << "</tr>\n";
  for (int t = 0; t < kNumMemoryTags; ++t) {
    std::string name(tag_name(static_cast<MemoryTag>(t)));
    os << "<tr><td>" << name << "</td><td>" << format_bytes(p.tag_peak[t]) << "</td><td>" << format_bytes(p.tag_at_peak[t])
       << "</td><td>" << format_bytes(p.tag_current[t]) << "</td>";
    if (planned) {
      int64_t pl = p.plan["tags"].value(name, int64_t{0});
      os << "<td>" << format_bytes(pl) << "</td><td>"
         << (p.tag_peak[t] > 0 ? num(100.0 * static_cast<double>(pl) / static_cast<double>(p.tag_peak[t])) + "%" : "-")
         << "</td>";
    }
    os << "</tr>\n";
  }
  os << "</table>\n<h2>Peaks by phase</h2><table><tr><th>phase</th><th>count</th><th>peak in use</th><th>in use at entry</th>"
        "<th>activation at peak</th><th>gradient at peak</th></tr>\n";
  for (const PhasePeak& ph : p.phases)
    os << "<tr><td>" << esc(ph.name) << "</td><td>" << ph.count << "</td><td>" << format_bytes(ph.peak_in_use) << "</td><td>"
       << format_bytes(ph.start_in_use) << "</td><td>"
       << format_bytes(ph.tags_at_peak[static_cast<int>(MemoryTag::Activation)]) << "</td><td>"
       << format_bytes(ph.tags_at_peak[static_cast<int>(MemoryTag::Gradient)]) << "</td></tr>\n";
  os << "</table>\n<h2>Recompute regions</h2><table><tr><th>region</th><th>forward peak</th><th>forward adds</th>"
        "<th>backward peak</th><th>backward adds</th></tr>\n";
  for (const RegionPeak& r : p.regions)
    os << "<tr><td>" << esc(r.name) << "</td><td>" << format_bytes(r.forward_peak) << "</td><td>"
       << format_bytes(r.forward_delta) << "</td><td>" << format_bytes(r.backward_peak) << "</td><td>"
       << format_bytes(r.backward_delta) << "</td></tr>\n";
  os << "</table>\n<h2>Largest live allocations at the peak</h2><table><tr><th>bytes</th><th>tag</th><th>made by</th>"
        "<th>at</th></tr>\n";
  for (const LiveAllocation& a : p.top_allocations)
    os << "<tr><td>" << format_bytes(a.bytes) << "</td><td>" << tag_name(a.tag) << "</td><td>" << esc(a.label) << "</td><td>"
       << num(a.time_s * 1000) << " ms</td></tr>\n";
  os << "</table>\n<h2>Live bytes at the peak by label</h2><table><tr><th>label</th><th>bytes</th></tr>\n";
  for (const auto& [l, b] : p.labels_at_peak) os << "<tr><td>" << esc(l) << "</td><td>" << format_bytes(b) << "</td></tr>\n";
  os << "</table>\n";
}

}  // namespace

std::string profile_to_html(const MemoryProfile& p) {
  std::ostringstream os;
  os << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Kestrel memory profile</title>\n<style>\n"
        "body{font-family:sans-serif;margin:16px;color:#222}table{border-collapse:collapse;margin-bottom:12px}"
        "td,th{border:1px solid #ddd;padding:3px 8px;text-align:right;font-size:12px}td:first-child,th:first-child{text-align:left}"
        "h1{font-size:18px}h2{font-size:15px;margin:14px 0 6px}.legend span{margin-right:14px;font-size:12px}"
        ".legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:middle}"
        "#readout{font-size:12px;color:#444;height:16px;margin:4px 0}\n</style></head><body>\n";
  os << "<h1>Kestrel memory profile &mdash; " << esc(p.device) << "</h1>\n<p>Peak in use <b>"
     << format_bytes(p.peak_in_use) << "</b> at " << num(p.peak_time_s * 1000) << " ms in <b>" << esc(p.peak_phase)
     << "</b>; reserved at the peak " << format_bytes(p.reserved_at_peak) << ", peak footprint "
     << format_bytes(p.peak_footprint) << ", external " << format_bytes(p.external) << "; budget "
     << (p.budget > 0 ? format_bytes(p.budget) : std::string("none"));
  if (p.plan.is_object())
    os << "; planned peak " << format_bytes(p.plan.value("peak", int64_t{0}))
       << (p.plan.value("fits", true) ? " (fits)" : " (does not fit)");
  os << ". " << p.num_events << " events" << (p.events_truncated ? " (log truncated)" : "") << ".</p>\n";
  if (p.meta.is_object() && !p.meta.empty()) os << "<p style=\"font-size:12px\">" << esc(p.meta.dump()) << "</p>\n";
  chart(os, p);
  tables(os, p);
  // The data, for tools and for the hover read-out. "</" is escaped so the JSON cannot end the script.
  std::string data = profile_to_json(p).dump();
  std::string safe;
  safe.reserve(data.size());
  for (size_t i = 0; i < data.size(); ++i) {
    if (data[i] == '<' && i + 1 < data.size() && data[i + 1] == '/') safe += "<\\";
    else safe += data[i];
  }
  os << "<script type=\"application/json\" id=\"memory-data\">" << safe << "</script>\n";
  os << R"JS(<script>
(function(){
  var d=JSON.parse(document.getElementById('memory-data').textContent), tl=d.timeline;
  var svg=document.getElementById('chart'), cur=document.getElementById('cursor'), out=document.getElementById('readout');
  if(!svg||!tl.t.length)return;
  var L=90,pw=1200-90-20,tmax=Math.max(tl.t[tl.t.length-1],1e-9);
  d.spans.forEach(function(s){tmax=Math.max(tmax,s.t1);});
  function fmt(b){var u=['B','KiB','MiB','GiB','TiB'],i=0;while(Math.abs(b)>=1024&&i<4){b/=1024;i++;}return (i?b.toFixed(2):b)+' '+u[i];}
  svg.addEventListener('mousemove',function(ev){
    var r=svg.getBoundingClientRect(),x=(ev.clientX-r.left)*1200/r.width,t=(x-L)/pw*tmax,lo=0,hi=tl.t.length-1;
    while(lo<hi){var m=(lo+hi+1)>>1;if(tl.t[m]<=t)lo=m;else hi=m-1;}
    cur.setAttribute('x1',x);cur.setAttribute('x2',x);cur.setAttribute('visibility','visible');
    var s=(t*1000).toFixed(2)+' ms: in use '+fmt(tl.in_use[lo]);
    tl.tags.forEach(function(n,k){if(tl.by_tag[k][lo])s+=', '+n+' '+fmt(tl.by_tag[k][lo]);});
    out.textContent=s;
  });
})();
</script>
</body></html>
)JS";
  return os.str();
}

}  // namespace kestrel::train
