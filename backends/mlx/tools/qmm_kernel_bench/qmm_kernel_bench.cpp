// The quantized matmul's inner loop alone (kernels/quantized_rows.h), no MLX, no threads: the
// [rows x 896] x [896 x 4864] product of `etmlx bench qmm`, timed by this thread's CPU time (robust on
// a shared machine, where wall time also counts other jobs) and by wall time; best of 20.
//   g++ -std=c++20 -O2 -I backends/mlx/runtime backends/mlx/tools/qmm_kernel_bench/qmm_kernel_bench.cpp
//       backends/mlx/runtime/kernels/quantized_rows*.cpp -o qmm_kernel_bench
//   ./qmm_kernel_bench BITS MATRICES ROWS [avx2|avx512|scalar]   (MATRICES 16: 35-43 MB, beyond the L3 cache)
#include <time.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include <cstring>
#include "kernels/quantized_rows.h"
#include "kernels/quantized_rows_variants.h"
using namespace etmlx::kernels;
double cpu_now(){timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+t.tv_nsec*1e-9;}
double wall_now(){timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char** argv){
  int N=4864,K=896,bits=atoi(argv[1]),G=64,L=atoi(argv[2]),m=atoi(argv[3]);
  const char* isa = argc>4? argv[4] : "avx2";
  const RowsVariant* v = strcmp(isa,"scalar")==0? &scalar_rows() : strcmp(isa,"avx512")==0? avx512_rows() : avx2_rows();
  std::mt19937 rng(1);
  size_t wb=(size_t)N*K*bits/8;
  std::vector<std::vector<uint32_t>> W(L, std::vector<uint32_t>(wb/4)); for(auto&w:W) for(auto&e:w) e=rng();
  std::vector<float> s((size_t)N*K/G, 0.01f), b(s.size(), -0.02f);
  std::vector<float> x((size_t)m*K), xp(x.size()), sums((size_t)m*K/G), out((size_t)m*N);
  for(auto&e:x) e=(rng()%1000)/1000.f;
  prepare_activations(x.data(),m,K,bits,G,xp.data(),sums.data());
  double best_cpu=1e9, best_wall=1e9;
  for(int rep=0;rep<20;rep++){
    double c0=cpu_now(), w0=wall_now();
    for(int l=0;l<L;l++){ QuantizedMatrix q{W[l].data(),s.data(),b.data(),ScaleType::f32,N,K,bits,G};
      for(int r0=0;r0<m;r0+=4){ PreparedRows pr{xp.data()+(size_t)r0*K,sums.data()+(size_t)r0*K/G,std::min(4,m-r0)}; v->dot(q,pr,0,N,out.data()+(size_t)r0*N,N);} }
    double c=(cpu_now()-c0)/L, w=(wall_now()-w0)/L; if(c<best_cpu)best_cpu=c; if(w<best_wall)best_wall=w;
  }
  double bytes = wb + s.size()*8;
  printf("%s bits %d L %d m %d: cpu %.3f ms (%.1f GB/s)  wall %.3f ms (%.1f GB/s)\n", v->name, bits, L, m, best_cpu*1e3, bytes/best_cpu/1e9, best_wall*1e3, bytes/best_wall/1e9);
  std::vector<float> deq((size_t)N*K); double bd=1e9;
  for(int rep=0;rep<10;rep++){double c0=cpu_now(); QuantizedMatrix q{W[0].data(),s.data(),b.data(),ScaleType::f32,N,K,bits,G}; v->dequantize(q,0,N,deq.data()); bd=std::min(bd,cpu_now()-c0);}
  printf("  dequantize: cpu %.3f ms\n", bd*1e3);
}
